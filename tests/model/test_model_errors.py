"""Files kvq cannot use fail with a ModelError that names the problem."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from kvq.errors import ModelError
from kvq.gguf import read_meta
from kvq.model import Backbone
from kvq.tools.synth import make_tiny


def _write(path: Path, arch: str, keys: dict[str, int]) -> None:
    w = GGUFWriter(str(path), arch)
    for key, value in keys.items():
        w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"definitely not a GGUF model file\n" * 4)
    with pytest.raises(ModelError, match=r"model\.bin.*not a readable GGUF"):
        read_meta(path)


@pytest.mark.parametrize("content", [b"", b"GG"])
def test_empty_or_tiny_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "short.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelError, match="short.gguf"):
        read_meta(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        read_meta(tmp_path / "absent.gguf")


def test_unsupported_arch(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    _write(path, "llama", {"llama.block_count": 1})
    with pytest.raises(ModelError, match=r"'llama'.*not supported.*qwen3moe"):
        read_meta(path)


def test_missing_metadata_key(tmp_path: Path) -> None:
    path = tmp_path / "partial.gguf"
    _write(path, "qwen3moe", {"qwen3moe.block_count": 1, "qwen3moe.expert_count": 4})
    with pytest.raises(ModelError, match="qwen3moe.embedding_length"):
        read_meta(path)


def test_missing_expert_tensor(tmp_path: Path) -> None:
    path = tmp_path / "no_experts.gguf"
    keys = {
        "qwen3moe.block_count": 1,
        "qwen3moe.embedding_length": 8,
        "qwen3moe.attention.head_count": 2,
        "qwen3moe.expert_count": 2,
        "qwen3moe.expert_used_count": 1,
        "qwen3moe.expert_feed_forward_length": 8,
        "qwen3moe.context_length": 16,
    }
    _write(path, "qwen3moe", keys)
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_gate_exps\.weight.*missing"):
        read_meta(path)
    with pytest.raises(ModelError, match="missing"):
        Backbone.from_gguf(path)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"experts_used": 9}, "experts_used=9"),
        ({"heads": 3}, "heads=3"),
        ({"head_dim": 15}, "head_dim=15"),
        ({"layers": 0}, "layers=0"),
    ],
)
def test_make_tiny_rejects_bad_dims(tmp_path: Path, kwargs: dict[str, int], words: str) -> None:
    with pytest.raises(ModelError, match=words):
        make_tiny(tmp_path / "bad.gguf", **kwargs)  # type: ignore[arg-type]


def test_truncated_file_is_a_model_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    make_tiny(path, quant="q8_0", hidden=64, expert_ffn=64)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])  # the last tensors lose their bytes
    with pytest.raises(ModelError, match="cut.gguf"):
        Backbone.from_gguf(cut)


def test_unknown_quant_type_is_a_model_error_naming_the_tensor(tmp_path: Path) -> None:
    from kvq.gguf.reader import check_supported

    with pytest.raises(ModelError, match="blk.0.ffn_up_exps.weight"):
        check_supported(31337, "blk.0.ffn_up_exps.weight")


def test_bytes_that_do_not_match_the_shape_are_a_model_error(tmp_path: Path) -> None:
    import torch

    from kvq.model.qstack import QStack
    from kvq.quant import dequantize

    with pytest.raises(ModelError, match="Q8_0"):
        dequantize(torch.zeros(33, dtype=torch.uint8), 8, (1, 32))
    with pytest.raises(ModelError, match="Q4_0"):
        QStack(torch.zeros(2, 17, dtype=torch.uint8), 2, (2, 1, 32))
