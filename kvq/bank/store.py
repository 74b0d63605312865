"""One layer's expert storage: every expert in the cold bank (host), the hot ones also in the
hot bank (device), and the slot map saying which is where.

The cold bank is the backing store: it holds all of the node's experts of the layer, so a swap
is one host-to-device copy into a hot slot and never a copy back. A quantized slice's cold
bank is its GGUF bytes as they are: on CPU the memory-mapped file itself (page cache, read
on use), on CUDA pinned host memory, which crosses PCIe as quantized bytes.

The hot bank holds each hot expert in the fastest compute format for the device. On a CPU
computing in float32, where a fused kernel covers the type (`kvq.quant.kernels`), that is the
encoded bytes themselves, copied into owned memory (resident, never evicted like page cache):
hot and cold experts then run the same kernel, so a swap changes no bit. Elsewhere (CUDA,
bf16, types without a kernel) hot experts are dequantized into the compute dtype for a plain
matmul, and a cold expert is dequantized per call into a reused per-thread buffer. Dense
slices (tests) keep dense cold banks, as before.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvq.bank import coldpath
from kvq.bank.coldpath import uva_view
from kvq.errors import BankError
from kvq.model.expert_slice import ExpertSlice, Stack
from kvq.model.experts import ExpertWeights
from kvq.model.qstack import QMatrix, QStack
from kvq.quant import dequantize, kernels

Weights = ExpertWeights


@dataclass(frozen=True, slots=True)
class SlotMap:
    """Which hot slot holds each expert of a layer (-1: cold). Published whole, never edited,
    so a forward that read one map sees one consistent assignment from start to end."""

    version: int
    slot_of: tuple[int, ...]  # [n] slot per local expert, -1 = cold
    ready: Any = None  # torch.cuda.Event: the copies the hot slots depend on (None: done)

    def hot_mask(self) -> list[bool]:
        return [s >= 0 for s in self.slot_of]


class LayerStore:
    """Experts `[start, end)` of one layer split over a hot (device) and a cold (host) bank."""

    def __init__(self, sl: ExpertSlice, hot: list[int], device: torch.device) -> None:
        self.layer, self.start, self.end = sl.layer, sl.expert_start, sl.expert_end
        self.n = sl.n_experts
        self.device = device
        self.dtype = sl.compute_dtype
        self.hidden = sl.hidden
        self.cold = tuple(_host(t, device) for t in sl.stacks)  # [n, ...] each
        self.quantized = sl.quantized
        self.act = sl.act
        # the experts' biases (gpt-oss): a few KB, always on the device whatever the slot
        self.biases = None if sl.biases is None else tuple(b.to(device) for b in sl.biases)
        self.cold_in_place: tuple[Stack, ...] | None = None  # device-readable cold views
        # hot slots hold the encoded bytes (a kernel computes them) or the dense matrices
        self.encoded = hot_encoded(self.cold, device, self.dtype)
        self.cold_expert_bytes = sum(_stored_nbytes(t) for t in self.cold)
        self.expert_bytes = (
            self.cold_expert_bytes
            if self.encoded
            else sum(_dense_nbytes(t, self.dtype) for t in self.cold)
        )
        locals_ = [e - self.start for e in hot]
        if any(not 0 <= e < self.n for e in locals_) or len(set(locals_)) != len(locals_):
            raise BankError(
                f"layer {self.layer}: hot set {hot} is not inside [{self.start}, "
                f"{self.end}) without repeats"
            )
        # [S, F, H], [S, F, H], [S, H, F] (or [S, bytes] each, encoded): slot s holds
        # expert locals_[s]
        self.hot = tuple(
            torch.empty((len(locals_), c.expert_nbytes), dtype=torch.uint8, device=device)
            if self.encoded and isinstance(c, QStack)
            else torch.empty((len(locals_), *_matrix_shape(c)), dtype=self.dtype, device=device)
            for c in self.cold
        )
        self.copy_in([(s, e) for s, e in enumerate(locals_)], [], None)
        slot_of = [-1] * self.n
        for s, e in enumerate(locals_):
            slot_of[e] = s
        self.map = SlotMap(0, tuple(slot_of))
        self.readers: Counter[int] = Counter()  # map version -> forwards using it now
        self.done: dict[int, Any] = {}  # CUDA stream id -> event after its last forward
        # [n + 1] routed pairs per local expert since the last update; slot n takes outsiders
        self.counter = torch.zeros(self.n + 1, dtype=torch.int64, device=device)
        self._scratch = threading.local()  # per thread: cold experts dequantized per call

    @property
    def slots(self) -> int:
        return int(self.hot[0].shape[0])

    def use_mapped(self) -> None:
        """Read cold experts in place: the host stacks on CPU, UVA views of them on CUDA."""
        if self.device.type == "cuda":
            self.cold_in_place = tuple(_uva(t, self.device) for t in self.cold)
        else:
            self.cold_in_place = self.cold

    def weights(self, m: SlotMap, e: int) -> Weights:
        """Expert `e` (local id) as seen through map `m`: its hot slot, or the cold bank read
        in place (mapped) or copied to the device now (staged); a quantized cold expert is
        dequantized into this thread's scratch buffers, valid until its next cold call."""
        s = m.slot_of[e]
        if self.encoded:
            return self._encoded(s, e)
        if s >= 0:
            return self.hot[0][s], self.hot[1][s], self.hot[2][s]
        src = self.cold_in_place
        bufs = self._buffers() if self.quantized else None
        out: list[torch.Tensor] = []
        for k, t in enumerate(src if src is not None else self.cold):
            if isinstance(t, QStack):
                raw = t.raw[e] if src is not None else t.raw[e].to(self.device, non_blocking=True)
                out.append(dequantize(raw, t.qtype, t.shape[1:], self.dtype, bufs[k]))  # type: ignore[index]
            else:
                out.append(t[e] if src is not None else t[e].to(self.device, non_blocking=True))
        return out[0], out[1], out[2]

    def bias(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Expert `e`'s (local id) gate, up and down biases, or None without biases."""
        b = self.biases
        return None if b is None else (b[0][e], b[1][e], b[2][e])

    def _encoded(self, slot: int, e: int) -> Weights:
        """Expert `e`'s encoded matrices: from hot slot `slot`, or the cold bank (slot -1)."""
        out: list[QMatrix] = []
        for k, c in enumerate(self.cold):
            assert isinstance(c, QStack)
            out.append(c.encoded(e, self.hot[k][slot] if slot >= 0 else None))
        return out[0], out[1], out[2]

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        bufs: tuple[torch.Tensor, ...] | None = getattr(self._scratch, "bufs", None)
        if bufs is None:
            bufs = tuple(
                torch.empty(h.shape[1:], dtype=self.dtype, device=self.device) for h in self.hot
            )
            self._scratch.bufs = bufs
        return bufs

    def unmap_outgoing(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Publish a map without the outgoing experts of (out, in) global id pairs; return the
        copies to make: (freed slot, incoming local id)."""
        slot_of = list(self.map.slot_of)
        jobs: list[tuple[int, int]] = []
        seen: set[int] = set()
        for out_e, in_e in pairs:
            o, i = out_e - self.start, in_e - self.start
            ok = 0 <= o < self.n and 0 <= i < self.n and slot_of[o] >= 0 and slot_of[i] < 0
            if not ok or {o, i} & seen:
                raise BankError(
                    f"layer {self.layer}: swap ({out_e} out, {in_e} in) needs a hot expert out "
                    "and a cold one in, each at most once"
                )
            seen |= {o, i}
            jobs.append((slot_of[o], i))
            slot_of[o] = -1
        self.map = SlotMap(self.map.version + 1, tuple(slot_of), self.map.ready)
        return jobs

    def map_incoming(self, jobs: list[tuple[int, int]], ready: Any) -> None:
        """Publish a map with the copied experts in their slots, guarded by `ready`."""
        slot_of = list(self.map.slot_of)
        for slot, e in jobs:
            slot_of[e] = slot
        self.map = SlotMap(self.map.version + 1, tuple(slot_of), ready or self.map.ready)

    def drained(self) -> bool:
        """No forward uses a map older than the current one."""
        return all(v >= self.map.version for v, n in self.readers.items() if n > 0)

    def copy_in(self, jobs: list[tuple[int, int]], waits: list[Any], stream: Any) -> Any:
        """Fill hot slots from the cold bank (`jobs`: (slot, local expert)), dequantizing
        quantized experts on the device. On CUDA the copies run on `stream` after `waits` and
        the returned event marks their end; on CPU they are done on return (None)."""
        if stream is None:
            for slot, e in jobs:
                for h, c in zip(self.hot, self.cold, strict=True):
                    _fill(h[slot], c, e, self.device, non_blocking=False)
            return None
        with torch.cuda.stream(stream):
            for ev in waits:
                stream.wait_event(ev)
            for slot, e in jobs:
                for h, c in zip(self.hot, self.cold, strict=True):
                    _fill(h[slot], c, e, self.device, non_blocking=True)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(stream)
        return ev


def hot_encoded(stacks: Iterable[Stack], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether hot slots hold these stacks' encoded bytes (a fused kernel computes every one
    of them on `device` in `dtype`) rather than dense matrices."""
    return all(
        isinstance(t, QStack) and kernels.keeps_encoded(t.qtype, device, dtype) for t in stacks
    )


def _fill(dst: torch.Tensor, src: Stack, e: int, device: torch.device, non_blocking: bool) -> None:
    """dst <- expert e of src: a copy, or quantized bytes moved to the device and decoded there."""
    if isinstance(src, QStack) and dst.dtype == torch.uint8:  # an encoded hot slot
        dst.copy_(src.raw[e], non_blocking=non_blocking)
    elif isinstance(src, QStack):
        raw = src.raw[e].to(device, non_blocking=non_blocking)  # [bytes]
        dequantize(raw, src.qtype, src.shape[1:], dst.dtype, dst)
    else:
        dst.copy_(src[e], non_blocking=non_blocking)


def _matrix_shape(t: Stack) -> tuple[int, int]:
    return (int(t.shape[1]), int(t.shape[2]))


def _dense_nbytes(t: Stack, dtype: torch.dtype) -> int:
    if isinstance(t, QStack):
        return t.dense_nbytes(dtype)
    return int(t[0].numel()) * torch.empty((), dtype=dtype).element_size()


def _stored_nbytes(t: Stack) -> int:
    return t.expert_nbytes if isinstance(t, QStack) else int(t[0].numel() * t.element_size())


def _host(t: Stack, device: torch.device) -> Stack:
    """The cold copy of a stacked expert tensor: host memory as it is (a mapped file stays
    mapped), pinned with CUDA."""
    if isinstance(t, QStack):
        return t.to("cpu", pin=device.type == "cuda")
    host = t.detach().to("cpu").contiguous()
    if device.type == "cuda":
        host = host.pin_memory()
    return host


def _uva(t: Stack, device: torch.device) -> Stack:
    if isinstance(t, QStack):
        return QStack(uva_view(t.raw, device), t.qtype, t.shape)
    return uva_view(t, device)


def choose_cold_path(
    stores: Iterable[LayerStore], want: str, device: torch.device
) -> tuple[str, str]:
    """Set up mapped (read in place) or staged reads of cold experts; measure both on the
    first layer with cold experts when `want` is auto. Returns (path, log sentence)."""
    stores = list(stores)
    if want == "staged":
        return "staged", "cold path: staged (forced)"
    try:
        for st in stores:
            st.use_mapped()
    except (BankError, RuntimeError, TypeError) as exc:
        for st in stores:
            st.cold_in_place = None
        return "staged", f"cold path: staged (mapped views failed: {exc})"
    probe = next((st for st in stores if st.slots < st.n), None)
    if want == "mapped" or probe is None or probe.cold_in_place is None:
        return "mapped", f"cold path: mapped ({'forced' if want == 'mapped' else 'no cold expert'})"
    views, cold_map = probe.cold_in_place, SlotMap(0, (-1,) * probe.n)

    def read(path: tuple[Stack, ...] | None) -> Weights:
        probe.cold_in_place = path
        return probe.weights(cold_map, probe.map.slot_of.index(-1))

    t = coldpath.measure(lambda: read(views), lambda: read(None), probe.hidden, probe.dtype, device)
    probe.cold_in_place = views
    where = "over PCIe" if device.type == "cuda" else "CPU: both banks are RAM"
    note = (
        f"cold path measured ({where}): mapped {t['mapped'] * 1e3:.3f} ms, "
        f"staged {t['staged'] * 1e3:.3f} ms per expert call"
    )
    if t["staged"] < t["mapped"]:
        for st in stores:
            st.cold_in_place = None
        return "staged", note + " -> staged"
    return "mapped", note + " -> mapped"
