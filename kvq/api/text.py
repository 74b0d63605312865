"""A model's tokenizer and chat template at the gateway: `/tokenize`, `/detokenize` (vLLM's
shapes) and the room a chat leaves in the context (its default `max_tokens`).

Read from the model's registered source when that is a file on this machine (the header only:
GGUF files are memory-mapped), once per model; the prompt is encoded as the coordinator
encodes it (`kvq.coordinator.intake.Intake.prompt`), so the counts agree. A source that is a URL has
no tokenizer here: `/tokenize` is 501 and a chat's `max_tokens` falls back to
`KVQ_API_MAX_TOKENS_DEFAULT`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq import wire
from kvq.catalog import ModelInfo
from kvq.errors import ApiError, ModelError
from kvq.prompts import render_chat


@dataclass(frozen=True, slots=True)
class ModelText:
    """What a gateway needs of one model to count and render its text."""

    context_length: int
    tokenizer: Any  # kvq.text.Tokenizer
    chat: Any  # kvq.text.chat.ChatTemplate

    def encode(
        self,
        prompt: str | None,
        messages: list[wire.ChatMessage] | None,
        add_special: bool = True,
        tools: str | None = None,
    ) -> list[int]:
        """The prompt's token ids as the coordinator computes them; 400 for a chat its
        template refuses."""
        if messages is None:
            return list(self.tokenizer.encode(prompt or "", add_bos=None if add_special else False))
        try:
            text = render_chat(self.chat, messages, tools)
        except ModelError as exc:
            raise ApiError(400, str(exc), param="messages", code="refused") from None
        return list(self.tokenizer.encode(text, add_bos=None if add_special else False))

    def room(self, ids: list[int]) -> int:
        """Tokens a request with this prompt may still generate (the coordinator refuses
        prompt + max_tokens > the context length)."""
        return self.context_length - len(ids)


class Texts:
    """ModelText per model, loaded on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[str, ModelText | None] = {}

    def get(self, info: ModelInfo) -> ModelText | None:
        """The model's text tools, or None when its file is not on this machine."""
        with self._lock:
            if info.model not in self._loaded:
                self._loaded[info.model] = _load(info)
            return self._loaded[info.model]


def _load(info: ModelInfo) -> ModelText | None:
    path = Path(info.source.removeprefix("file://"))
    if "://" in info.source.removeprefix("file://") or not path.is_file():
        return None
    from kvq.text import load_tokenizer
    from kvq.text.chat import load_chat_template

    return ModelText(info.meta.context_length, load_tokenizer(path), load_chat_template(path))
