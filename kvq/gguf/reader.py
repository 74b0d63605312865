"""Thin helpers over `gguf.GGUFReader`: open with kvq errors, typed metadata, type checks.

Shapes: GGUF stores dims fastest-first (ggml `ne0, ne1, ...`); numpy order is the reverse.
Everything kvq hands out uses numpy order, e.g. `ffn_gate_exps` is `[experts, ffn, hidden]`.
Dequantization lives in `kvq.quant`.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf import quants as gguf_quants

from kvq.errors import ModelError

# every type kvq reads and the synthetic writers (kvq.tools.synth.quants) encode; dequantization
# of each is tested against its encoder
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.MXFP4,
)

# every type kvq reads: what gguf can dequantize (its numpy reference), plus F32/F16
READABLE_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {*SUPPORTED_TYPES, *getattr(gguf_quants, "_type_traits", {})}
)


_READERS: OrderedDict[tuple[str, int, int, int], GGUFReader] = OrderedDict()
_READERS_KEPT = 4  # parsed headers kept: a real model's vocabulary takes seconds to parse
_readers_lock = threading.Lock()


def open_reader(path: str | Path) -> GGUFReader:
    """Memory-map `path` as GGUF; any failure becomes a ModelError naming the file.

    Parsing the metadata of a real model (a 150k-token vocabulary) takes seconds, and loading
    reads it three times (metadata, tensors, tokenizer), so the last few readers are kept,
    keyed by the file's identity (path, inode, size, mtime): a rewritten file is parsed anew.
    """
    try:
        st = os.stat(path)
        key = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
        with _readers_lock:
            reader = _READERS.get(key)
            if reader is None:
                reader = _READERS[key] = GGUFReader(str(path), "r")
                while len(_READERS) > _READERS_KEPT:
                    _READERS.popitem(last=False)
            _READERS.move_to_end(key)
            return reader
    except FileNotFoundError as exc:
        raise ModelError(f"model file {str(path)!r} does not exist; check the path") from exc
    except (OSError, ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
        raise ModelError(
            f"{str(path)!r} is not a readable GGUF file ({exc}); "
            "pass a GGUF model written by llama.cpp's converter or kvq.tools.synth.make_tiny"
        ) from exc


def header_sha256(path: str | Path) -> str:
    """sha256 of everything before the tensor data (header, metadata, tensor table)."""
    end = int(open_reader(path).data_offset)
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(end)).hexdigest()


def field(reader: GGUFReader, key: str, default: Any = None, *, required: bool = True) -> Any:
    """The value of metadata `key` (str, int, float or list); ModelError if required and absent."""
    f = reader.get_field(key)
    if f is None:
        if required:
            raise ModelError(f"GGUF metadata key {key!r} is missing; the file is incomplete")
        return default
    return f.contents()


def int_field(reader: GGUFReader, key: str, default: int | None = None) -> int:
    """Metadata `key` as an int (required unless `default` is given)."""
    value = field(reader, key, default, required=default is None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"GGUF metadata {key!r} = {value!r} is not an integer")
    return value


def float_field(reader: GGUFReader, key: str, default: float | None = None) -> float:
    """Metadata `key` as a float (required unless `default` is given)."""
    value = field(reader, key, default, required=default is None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelError(f"GGUF metadata {key!r} = {value!r} is not a number")
    return float(value)


def str_field(reader: GGUFReader, key: str, default: str | None = None) -> str:
    """Metadata `key` as a str (required unless `default` is given)."""
    value = field(reader, key, default, required=default is None)
    if not isinstance(value, str):
        raise ModelError(f"GGUF metadata {key!r} = {value!r} is not a string")
    return value


def bool_field(reader: GGUFReader, key: str, default: bool) -> bool:
    """Metadata `key` as a bool (`default` when absent)."""
    value = field(reader, key, default, required=False)
    if not isinstance(value, bool):
        raise ModelError(f"GGUF metadata {key!r} = {value!r} is not a boolean")
    return value


def array_len(reader: GGUFReader, key: str) -> int:
    """Length of array metadata `key` without decoding its items (0 when absent)."""
    f = reader.get_field(key)
    return 0 if f is None else len(f.data)


def tensor_map(reader: GGUFReader) -> dict[str, ReaderTensor]:
    """Tensors of the file by name."""
    return {t.name: t for t in reader.tensors}


def numpy_shape(t: ReaderTensor) -> tuple[int, ...]:
    """Logical (dequantized) numpy shape of a tensor: ggml dims reversed."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def quant_type(raw: int, name: str = "") -> GGMLQuantizationType:
    """`raw` as a ggml type, or ModelError naming it (and the tensor, if given)."""
    try:
        return GGMLQuantizationType(raw)
    except ValueError as exc:
        of = f" of tensor {name!r}" if name else ""
        raise ModelError(
            f"unknown ggml tensor type {raw}{of}; this gguf package cannot decode it"
        ) from exc


def check_supported(raw: int, name: str) -> GGMLQuantizationType:
    """The ggml type of tensor `name`, or ModelError if kvq cannot decode it."""
    qtype = quant_type(raw, name)
    if qtype not in READABLE_TYPES:
        raise ModelError(
            f"tensor {name!r} is stored as {qtype.name}, which kvq does not support; "
            f"re-quantize the model to one of {', '.join(t.name for t in SUPPORTED_TYPES)}"
        )
    return qtype


def nbytes_for(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Encoded size of a tensor of numpy `shape`; rows must be whole quant blocks."""
    block, type_size = GGML_QUANT_SIZES[quant_type(ggml_type)]
    if not shape or shape[-1] % block:
        raise ModelError(
            f"row length {shape[-1:]} is not a multiple of the {quant_type(ggml_type).name} "
            f"block size {block}; the tensor cannot be split by rows"
        )
    return int(math.prod(shape) // block * type_size)
