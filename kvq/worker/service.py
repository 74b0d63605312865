"""The worker process: volunteer → download → register → serve, over outbound Redis only.

Life cycle:
1. idle: poll every model's demand through the atomic volunteer script (K9, K11);
2. given a slice: fetch exactly its bytes, verify checksums, decode into tensors;
3. heartbeat on a thread (a key that expires), re-asserting its slice after a reap or a Redis
   restart;
4. serve: XREADGROUP BLOCK on its own inbox, pending entries first; each job's result is
   written before the job is acknowledged; malformed entries go to the dead-letter stream.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import redis
import torch

from kvq import wire
from kvq.bank import Bank, BankOptions
from kvq.bus import Backoff, Consumer, Scripts, connect, dead_letter, is_connection_error, xadd
from kvq.config import Settings
from kvq.device import compute_dtype, pick_device
from kvq.errors import BankError, KvqError, WireError
from kvq.keys import WORKER_GROUP, Keys
from kvq.model import decode_slice
from kvq.registry import SliceSpec, list_models, load_model
from kvq.worker.fetch import fetch_slice

log = logging.getLogger("kvq.worker")


@dataclass
class Holding:
    """The slice a worker serves, in a hot/cold bank."""

    model: str
    spec: SliceSpec
    bank: Bank
    hidden: int  # the model's embedding length: every job's x is [T, hidden]


class Worker:
    """One worker; `run()` until `stop` is set (or it idles out)."""

    def __init__(self, settings: Settings, worker_id: str) -> None:
        self.s, self.id = settings, worker_id
        self.keys = Keys(settings.prefix)
        self.r = connect(settings)
        self.scripts = Scripts(self.r, self.keys)
        self.device = pick_device(settings.device)
        self.dtype = compute_dtype(self.device)
        self.holding: Holding | None = None
        self.consumer: Consumer | None = None
        self.stop = threading.Event()
        self._holding_lock = threading.Lock()  # a heartbeat never interleaves with leaving
        self.served = 0
        self.last_serve_ms = 0
        self._idle_since = time.monotonic()

    # -- main loop -----------------------------------------------------------------------
    def run(self) -> None:
        backoff = Backoff(self.s.reconnect_max_s)
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        try:
            while not self.stop.is_set():
                try:
                    if self.holding is None:
                        if not self._volunteer():
                            self._maybe_idle_out()
                            self.stop.wait(self.s.volunteer_poll_s)
                    else:
                        self._serve_batch()
                    backoff.reset()
                except redis.RedisError as exc:
                    if not is_connection_error(exc):
                        raise
                    log.warning("redis unreachable (%s); retrying", exc)
                    backoff.wait()
                    if self.consumer is not None:
                        self.consumer.reset_pending()
        finally:
            self.stop.set()
            hb.join(timeout=2)
            self._leave()

    def _maybe_idle_out(self) -> None:
        if self._idle_for() > self.s.idle_shutdown_s > 0:
            log.info("no demand for %.0fs; shutting down", self._idle_for())
            self.stop.set()

    # -- volunteering and loading --------------------------------------------------------
    def _volunteer(self) -> bool:
        for model in list_models(self.r, self.keys):
            sid = self.scripts.volunteer(self.r, model, self.id)
            if sid is None:
                continue
            try:
                self._load(model, sid)
            except KvqError as exc:
                log.error("cannot serve %s %s: %s", model, sid, exc)
                self.scripts.release(self.r, model, self.id)
                if isinstance(exc, BankError):
                    raise  # this node's bank settings cannot work: retrying would loop forever
                continue
            return True
        return False

    def _load(self, model: str, sid: str) -> None:
        info = load_model(self.r, self.keys, model)
        spec = info.slices[sid]
        t0 = time.monotonic()
        blobs = fetch_slice(info.source, spec, self.s.download_timeout_s)
        per_layer = len(spec.ranges) // (spec.layer_end - spec.layer_start)
        experts = {}
        for i, layer in enumerate(spec.layers()):
            part = blobs[i * per_layer : (i + 1) * per_layer]
            experts[layer] = decode_slice(
                spec.ranges_of(layer), part, layer, spec.expert_start, spec.expert_end,
                device=str(self.device), dtype=self.dtype,
            )  # fmt: skip
        bank = Bank(experts.values(), BankOptions.from_settings(self.s), self.device)
        self.holding = Holding(model, spec, bank, info.meta.embedding_length)
        self._idle_since = time.monotonic()  # idleness counts from getting the slice
        self.consumer = Consumer(self.r, self.keys.worker_inbox(self.id), WORKER_GROUP, self.id)
        self._beat()
        log.info(
            "serving %s %s (%d bytes in %.2fs) on %s",
            model, sid, spec.nbytes, time.monotonic() - t0, self.device,
        )  # fmt: skip

    # -- heartbeat -----------------------------------------------------------------------
    def _beat(self) -> None:
        with self._holding_lock:
            self._beat_locked()

    def _beat_locked(self) -> None:
        h = self.holding
        if h is None:
            return
        self.scripts.rejoin(self.r, h.model, self.id, h.spec.sid)
        pipe = self.r.pipeline(transaction=False)
        pipe.set(
            self.keys.worker_heartbeat(self.id), h.spec.sid, px=int(self.s.heartbeat_ttl_s * 1000)
        )
        pipe.hset(
            self.keys.worker_info(self.id),
            mapping={
                "model": h.model, "slice": h.spec.sid, "device": str(self.device),
                "served": self.served, "last_serve_ms": self.last_serve_ms,
            },
        )  # fmt: skip
        pipe.expire(self.keys.worker_info(self.id), int(self.s.heartbeat_ttl_s * 10) + 1)
        pipe.execute()

    def _heartbeat_loop(self) -> None:
        while not self.stop.wait(self.s.heartbeat_ttl_s / 3):
            try:
                self._beat()
            except redis.RedisError as exc:
                log.debug("heartbeat failed: %s", exc)

    def _leave(self) -> None:
        with self._holding_lock:
            h, self.holding = self.holding, None
            if h is None:
                return
            try:
                self.scripts.release(self.r, h.model, self.id)
                self._forget()  # jobs still in the inbox are recomputed by their coordinator
            except redis.RedisError:
                pass  # the monitor reaps us once the heartbeat expires

    # -- serving -------------------------------------------------------------------------
    def _serve_batch(self) -> None:
        assert self.consumer is not None
        entries = self.consumer.read(count=32, block_ms=self.s.block_ms)
        for eid, fields in entries:
            self._serve_one(eid, fields)
        if entries:
            self._idle_since = time.monotonic()
            if self.holding is not None:
                self.holding.bank.step()  # B5: a batch of jobs is this node's engine step
        elif self._idle_for() > self.s.idle_shutdown_s > 0:
            self._retire_if_surplus()

    def _idle_for(self) -> float:
        return time.monotonic() - self._idle_since

    def _retire_if_surplus(self) -> None:
        """K10: idle and beyond its slice's target → give the slice back and exit."""
        h = self.holding
        assert h is not None
        with self._holding_lock:
            if self.scripts.retire(self.r, h.model, self.id) is None:
                self._idle_since = time.monotonic()  # still needed; look again later
                return
            self.holding = None  # the heartbeat must not rejoin
            self._forget()
        log.info("idle %.0fs and %s is over-covered: leaving", self._idle_for(), h.spec.sid)
        self.stop.set()

    def _forget(self) -> None:
        k = self.keys
        self.r.delete(k.worker_heartbeat(self.id), k.worker_info(self.id), k.worker_inbox(self.id))

    def _serve_one(self, eid: bytes, fields: dict[bytes, bytes]) -> None:
        assert self.consumer is not None and self.holding is not None
        try:
            job = wire.decode(fields, wire.Job)
            self._check_job(job)
        except WireError as exc:
            dead_letter(
                self.r, self.keys, self.consumer.stream, eid, fields, str(exc), self.s.stream_maxlen
            )
            self.consumer.ack(eid)
            log.warning("dead-lettered %s: %s", eid.decode(), exc)
            return
        if job.deadline_ms and time.time() * 1000 > job.deadline_ms:
            self.consumer.ack(eid)  # the coordinator has already computed it locally
            return
        t0 = time.perf_counter()
        y: wire.Tensor | None = None
        error: wire.Failure | None = None
        try:
            y = wire.Tensor.of(self.compute(job))
        except Exception as exc:  # noqa: BLE001 - report, never crash on one job
            log.exception("job %s failed", job.job_id)
            error = wire.failure(exc)
        ms = (time.perf_counter() - t0) * 1000
        result = wire.Result(job_id=job.job_id, worker=self.id, compute_ms=ms, y=y, error=error)
        self.served += 1
        self.last_serve_ms = int(time.time() * 1000)
        pipe = self.r.pipeline(transaction=False)
        xadd(pipe, job.reply_to, wire.encode(result), self.s.stream_maxlen)
        pipe.xack(self.consumer.stream, self.consumer.group, eid)
        pipe.execute()

    def _check_job(self, job: wire.Job) -> None:
        h = self.holding
        assert h is not None
        if job.model != h.model or job.layer not in h.bank.layers:
            raise WireError(
                f"job {job.job_id} for {job.model} layer {job.layer}: not my slice {h.spec.sid}"
            )
        if (job.expert_start, job.expert_end) != (h.spec.expert_start, h.spec.expert_end):
            raise WireError(
                f"job {job.job_id} experts [{job.expert_start},{job.expert_end}) != {h.spec.sid}"
            )
        if job.x.shape[1] != h.hidden:
            raise WireError(
                f"job {job.job_id}: hidden size {job.x.shape[1]} does not match the model"
            )

    def compute(self, job: wire.Job) -> np.ndarray:
        """The slice's gate-weighted expert sum per row, as float32 numpy [T, H]."""
        assert self.holding is not None
        x = torch.from_numpy(np.array(job.x.array(), dtype=np.float32)).to(self.device, self.dtype)
        ids = torch.from_numpy(np.array(job.ids.array(), dtype=np.int64)).to(self.device)
        w = torch.from_numpy(np.array(job.weights.array(), dtype=np.float32)).to(
            self.device, self.dtype
        )
        with torch.inference_mode():
            y = self.holding.bank.forward(job.layer, x, ids, w)
        return y.float().cpu().numpy()
