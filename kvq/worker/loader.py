"""Loading one slice: fetch its bytes, decode them into a bank, warm it up, wrap it in a server.

No Redis writes, no worker state: `Loader.load` runs on the worker's main thread while it serves
nothing, and on a thread of its own beside the serving loop while it serves other slices
(`Worker`), so a second slice's download never stalls the first slice's jobs.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from kvq.bank import Bank, BankOptions
from kvq.bank.server import ExpertServer
from kvq.bus.board import Board
from kvq.bus.market import Held
from kvq.device import compute_dtype
from kvq.errors import ModelError, SliceIntegrityError
from kvq.model import ExpertSlice, decode_slice
from kvq.model.qstack import FileMap
from kvq.model.stage import load_stage, write_stage_file
from kvq.quant import kernels
from kvq.slices import SliceSpec
from kvq.worker.fetch import fetch_slice
from kvq.worker.stage import StageServer, warm_up_stage

log = logging.getLogger("kvq.worker")


Fingerprint = tuple[str, ...]  # model, slice, source, the slice's published sha256s


class TamperedSource(SliceIntegrityError):
    """The source's bytes of a slice differ from its published checksums (a tampered or
    another file): the same bytes would come again. `again`: refused without downloading,
    since this fingerprint failed before."""

    def __init__(self, message: str, fingerprint: Fingerprint, again: bool = False) -> None:
        super().__init__(message)
        self.fingerprint, self.again = fingerprint, again


@dataclass(frozen=True, slots=True)
class Loaded:
    """A slice ready to serve: its server and its published bytes (what the budget counts)."""

    held: Held
    server: ExpertServer | StageServer
    nbytes: int
    seconds: float  # fetch + decode + warm-up
    warm_s: float


@dataclass(frozen=True, slots=True)
class Loader:
    """How worker `name` loads slices from `board`'s model table onto `device`."""

    board: Board
    name: str
    device: torch.device
    compute_dtype: str
    download_timeout_s: float
    bank_options: BankOptions
    stage_max_seqs: int = 256  # KVQ_STAGE_MAX_SEQS: sequence states a stage slice keeps

    def load(
        self,
        held: Held,
        progress: Callable[[int, int], None],
        quiet: bool = False,
        refused: Collection[Fingerprint] = (),
    ) -> Loaded:
        """The slice `held`, loaded (KvqError when it cannot be: unregistered, unreachable,
        corrupt, or a bank these settings cannot build). `quiet`: its "loading" and bank lines
        at DEBUG (a worker's later slices: its "serving" line says what each one cost).
        `refused`: fingerprints whose bytes failed their checksums before (`TamperedSource`),
        not downloaded again."""
        level = logging.DEBUG if quiet else logging.INFO
        info = self.board.model_info(held.model)
        if info is None:
            raise ModelError(f"model {held.model!r} is no longer registered")
        spec = info.slices[held.sid]
        fp = (held.model, held.sid, info.source, *spec.sha256)
        if fp in refused:
            why = f"{info.source} gave bytes of {held.sid} that failed their checksums before"
            raise TamperedSource(why, fp, again=True)
        dtype = compute_dtype(self.device, self.compute_dtype, (r.ggml_type for r in spec.ranges))
        t0 = time.monotonic()
        log.log(
            level,
            "loading %s %s (%.1f MB from %s)",
            held.model,
            held.sid,
            spec.nbytes / 1e6,
            info.source,
        )
        progress(0, spec.nbytes)
        try:
            blobs = fetch_slice(info.source, spec, self.download_timeout_s, progress)
        except SliceIntegrityError as exc:
            raise TamperedSource(str(exc), fp) from None
        log.log(
            level,
            "downloaded %s %s (%.1f MB in %.1fs, checksums match); warming up with %s",
            held.model,
            held.sid,
            spec.nbytes / 1e6,
            time.monotonic() - t0,
            kernels.describe(self.device.type),
        )
        if spec.is_stage:
            stage = self._stage(held, spec, blobs, info.meta.file_size, dtype)
            warm_s = warm_up_stage(stage)
            return Loaded(held, stage, spec.nbytes, time.monotonic() - t0, warm_s)
        experts = self._experts(spec, blobs, dtype, info.meta.expert_act)
        bank = Bank(experts, self.bank_options, self.device, log_level=level)
        hidden = info.meta.embedding_length
        warm_s = warm_up(bank, hidden, dtype, self.device)
        # deadlines are on Redis's clock: this host's may be minutes off the coordinator's
        server = ExpertServer(self.name, held.model, bank, hidden, dtype, self.board.now_ms)
        return Loaded(held, server, spec.nbytes, time.monotonic() - t0, warm_s)

    def _experts(
        self, spec: SliceSpec, blobs: list[bytes], dtype: torch.dtype, act: str
    ) -> list[ExpertSlice]:
        """The slice's experts decoded, one entry a layer (blobs come in range order: layer by
        layer)."""
        experts: list[ExpertSlice] = []
        at = 0
        for layer in spec.layers():
            ranges = spec.ranges_of(layer)
            part, at = blobs[at : at + len(ranges)], at + len(ranges)
            experts.append(
                decode_slice(
                    ranges,
                    part,
                    layer,
                    spec.expert_start,
                    spec.expert_end,
                    device=str(self.device),
                    dtype=dtype,
                    act=act,
                )
            )
        return experts

    def _stage(
        self, held: Held, spec: SliceSpec, blobs: list[bytes], file_size: int, dtype: torch.dtype
    ) -> StageServer:
        """A stage slice (X12): its verified bytes written into a sparse copy of the model
        file, its blocks mapped from it, the file unlinked at once (the maps keep the bytes
        until the server is dropped; a crash leaves nothing behind)."""
        path = _stage_file()
        try:
            write_stage_file(spec, blobs, path, file_size)
            backbone = load_stage(spec, path, self.device, dtype)
        finally:
            FileMap.forget(path)  # the tensors hold their maps; the path may be reused
            os.unlink(path)
        return StageServer(
            self.name, held.model, held.sid, backbone, self.stage_max_seqs, self.board.now_ms
        )


def _stage_file() -> str:
    fd, path = tempfile.mkstemp(prefix="kvq-stage-", suffix=".gguf")
    os.close(fd)
    return path


def warm_up(bank: Bank, hidden: int, dtype: torch.dtype, device: torch.device) -> float:
    """Run every expert the bank holds once (one row each) before the worker says it serves
    (K4): page faults, kernel compilation and allocator growth happen here, not in the first
    jobs, so the coordinator's first samples of this worker are warm. Returns the seconds."""
    t0 = time.monotonic()
    with torch.no_grad():
        for layer in bank.layers:
            lo, hi = bank.expert_range(layer)
            n = hi - lo
            x = torch.ones(n, hidden, dtype=dtype, device=device)  # [n, H]
            ids = torch.arange(lo, hi, device=device)[:, None]  # [n, 1]: one expert per row
            bank.forward(layer, x, ids, torch.ones(n, 1, device=device))
    return time.monotonic() - t0
