"""EOS ends a served sequence without being streamed or counted, as `kvq generate` does
(issue 12 item 4)."""

from __future__ import annotations

from pathlib import Path

from kvq.coordinator.engine import Engine, Sequence
from kvq.model import Backbone
from kvq.model.generate import generate
from kvq.text import load_tokenizer
from kvq.tools.synth import make_tiny


def test_eos_is_not_a_token(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    make_tiny(path, layers=1, experts=4, experts_used=2)
    bb, tok = Backbone.from_gguf(path), load_tokenizer(path)
    prompt = tok.encode("hello")
    greedy = generate(bb, prompt, 3, stop_at_eos=False)
    tok.eos_id = greedy[2]  # the third greedy token ends the sequence
    k = greedy.index(tok.eos_id)  # where greedy decoding first meets it
    engine = Engine(bb, tok, n_slots=1)
    engine.admit("r", prompt, 8, b"")
    streamed: list[int | None] = []
    finished: list[Sequence] = []
    while engine.busy:
        finished += engine.step(None, lambda seqs: streamed.extend(s.new_token for s in seqs))
    (seq,) = finished
    assert seq.finish == "eos"
    assert seq.generated == greedy[:k], "as kvq generate does, EOS is not a generated token"
    assert streamed == [*greedy[:k], None], "the EOS step streams no token"
