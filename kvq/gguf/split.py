"""`kvq model split --backbone`: a GGUF without the routed experts' bytes, for a coordinator
that holds only the backbone while workers hold every expert.

The backbone file keeps every metadata key and every non-routed tensor (embeddings, attention,
norms, routers, shared experts, dense FFNs, output) byte for byte, and adds:

    kvq.routed_experts        "absent"
    kvq.source.size           the full file's size in bytes
    kvq.source.header_sha256  sha256 of the full file's header (what a registration records)
    kvq.source.sha256         sha256 of the whole full file

A coordinator started on it checks the source fields against the model's registration
(`kvq.gguf.registry.check_backbone_file`): workers fetch their slices from the registered
source, so the two must be the same file.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter, ReaderTensor

from kvq.errors import ModelError
from kvq.gguf import reader as gio
from kvq.gguf.meta import ROUTED_EXPERTS_ABSENT, ROUTED_EXPERTS_KEY, read_meta

SOURCE_SIZE_KEY = "kvq.source.size"
SOURCE_HEADER_KEY = "kvq.source.header_sha256"
SOURCE_SHA_KEY = "kvq.source.sha256"
# every block's routed expert stacks (and their biases), MTP blocks included
_ROUTED = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.(weight|bias)$")
_CHUNK = 1 << 22


@dataclass(frozen=True, slots=True)
class BackboneSource:
    """What a backbone file records of the full file it was split from."""

    size: int
    header_sha256: str
    sha256: str


@dataclass(frozen=True, slots=True)
class SplitReport:
    """What `write_backbone` wrote."""

    out: str
    kept: tuple[str, ...]  # tensor names, in file order
    dropped: tuple[str, ...]
    source_bytes: int  # size of the full file
    backbone_bytes: int  # size of the written file
    dropped_bytes: int  # bytes of the routed expert tensors left out
    source: BackboneSource


def is_routed(name: str) -> bool:
    """Whether tensor `name` is a routed expert stack (what workers hold)."""
    return _ROUTED.match(name) is not None


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_backbone(src: str | Path, out: str | Path) -> SplitReport:
    """Write `out`: `src` without its routed experts' bytes (see the module docstring)."""
    if Path(src).resolve() == Path(out).resolve():
        raise ModelError(f"--backbone {str(out)!r} would overwrite the model it is split from")
    meta = read_meta(src)  # validates the arch and every tensor first
    if not meta.holds_experts:
        raise ModelError(f"{str(src)!r} is a backbone file already (no routed experts to drop)")
    reader = gio.open_reader(src)
    source = BackboneSource(meta.file_size, gio.header_sha256(src), file_sha256(src))
    kept = [t for t in reader.tensors if not is_routed(t.name)]
    dropped = [t for t in reader.tensors if is_routed(t.name)]
    named = {r.name for layer in meta.expert_tensors.values() for r in layer.values()}
    missing = named - {t.name for t in dropped}
    if missing:  # a naming this module does not know: refuse rather than keep expert bytes
        raise ModelError(f"routed expert tensors {sorted(missing)} were not recognised")
    w = GGUFWriter(str(out), meta.arch)
    w.data_alignment = reader.alignment
    _copy_metadata(reader, w)
    ffn_key = f"{meta.arch}.expert_feed_forward_length"
    if reader.get_field(ffn_key) is None:  # read_meta reads it from a dropped tensor otherwise
        w.add_uint32(ffn_key, meta.expert_feed_forward_length)
    w.add_string(ROUTED_EXPERTS_KEY, ROUTED_EXPERTS_ABSENT)
    w.add_uint64(SOURCE_SIZE_KEY, source.size)
    w.add_string(SOURCE_HEADER_KEY, source.header_sha256)
    w.add_string(SOURCE_SHA_KEY, source.sha256)
    for t in kept:
        w.add_tensor(t.name, _raw_bytes(t), raw_dtype=gio.quant_type(int(t.tensor_type)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return SplitReport(
        str(out),
        tuple(t.name for t in kept),
        tuple(t.name for t in dropped),
        meta.file_size,
        Path(out).stat().st_size,
        sum(int(t.n_bytes) for t in dropped),
        source,
    )


def _copy_metadata(reader: GGUFReader, w: GGUFWriter) -> None:
    """Every key of `reader` but the ones a writer sets itself, with its own value types."""
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or not f.types:
            continue
        if name.startswith("kvq.source.") or name == ROUTED_EXPERTS_KEY:
            continue  # written anew
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        if sub == GGUFValueType.ARRAY:
            raise ModelError(f"metadata {name!r} is a nested array; kvq cannot copy it")
        w.add_key_value(name, f.contents(), vtype, sub)


def _raw_bytes(t: ReaderTensor) -> np.ndarray:
    """The tensor's encoded bytes as uint8 `[..., row bytes]` (the writer's raw form)."""
    shape = gio.numpy_shape(t)
    block, type_size = GGML_QUANT_SIZES[gio.quant_type(int(t.tensor_type))]
    flat = np.asarray(t.data).reshape(-1).view(np.uint8)
    if flat.size != int(t.n_bytes):
        raise ModelError(f"tensor {t.name!r}: {flat.size} bytes, its table says {t.n_bytes}")
    return flat.reshape(*shape[:-1], shape[-1] // block * type_size)


def backbone_source(path: str | Path) -> BackboneSource | None:
    """The full file a backbone file was split from, or None for a file with its experts."""
    reader = gio.open_reader(path)
    if gio.str_field(reader, ROUTED_EXPERTS_KEY, "") != ROUTED_EXPERTS_ABSENT:
        return None
    return BackboneSource(
        gio.int_field(reader, SOURCE_SIZE_KEY),
        gio.str_field(reader, SOURCE_HEADER_KEY),
        gio.str_field(reader, SOURCE_SHA_KEY),
    )
