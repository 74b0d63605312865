"""Stage grain on the coordinator (X12): each sequence's rows cross a chain of stage holders.

The coordinator of a stage-grain model keeps the embedding, the output head, sampling and each
sequence's token history; every block runs on the workers holding its span. One engine step
sends each span one job per holder in use (`wire.StageJob`: the rows of the sequences on that
holder), waits for the answers, and sends the rows they return to the next span: a token
crosses the network once per stage, not once per MoE layer.

Chains (HECATE's pipelines, H1-H8) are per sequence and per span: a sequence takes the cheapest
live holder of each span when it first needs it (H3's node cost from the router's telemetry,
plus the sequences this coordinator already has there) and sticks to it while it lives, since
its state is there. When a holder dies (its heartbeat expires while a job waits), fails a job,
misses the stage deadline or answers `StateLost`, the sequences it held move to another holder
of the span (or stay, for `StateLost`), and their state is rebuilt by replaying their tokens:
the sequence runs again from position 0 through every span up to the failed one (`start` 0
drops whatever a holder kept) and then on. No request fails while a live holder of every span
exists; with none, the step waits `KVQ_REPLICA_WAIT_S` for one and then raises NoReplica.

Finished sequences are forgotten by their holders through the next job sent to each (`drop`),
found when the engine lets go of their caches.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from kvq import wire
from kvq.bus.board import Fields
from kvq.bus.records import DispatchCounters
from kvq.catalog import ModelInfo
from kvq.coordinator.mailbox import Mailbox
from kvq.coordinator.pending import Pending, latency_ms
from kvq.coordinator.routing import SliceRouter
from kvq.errors import NoReplica, RoutingError
from kvq.model import Backbone, KVCache, SeqStep
from kvq.slices import SliceSpec

log = logging.getLogger("kvq.coordinator")
STATE_LOST = "StateLost"
_POLL_MS = 50  # a wait for stage answers rereads the holders' liveness this often


@dataclass
class _Seq:
    """A sequence as the chain knows it: its key, the tokens its holders hold, its holders."""

    key: str
    fed: list[int] = field(default_factory=list)  # tokens at positions 0..len-1, committed
    holders: dict[str, str] = field(default_factory=dict)  # span sid -> worker


@dataclass
class _Rows:
    """One step's rows of a sequence on their way through the chain."""

    seq: _Seq
    tokens: list[int]  # the step's new tokens
    x: torch.Tensor  # [n, H] the rows entering the next span
    start: int  # the position of the first row, in every span (0 after a replay)


@dataclass
class _Outcome:
    """What went wrong in one round of a span's jobs: rows to replay (each with the holder
    to rebuild on, None: pick another) and rows to send again as they were."""

    replay: list[tuple[_Rows, str | None]] = field(default_factory=list)
    resend: list[_Rows] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


@dataclass
class ChainStats:
    """What the chain counts (docs/routing.md, "Stage grain")."""

    stage_jobs: int = 0
    replays: int = 0  # sequences whose state was rebuilt by replaying their tokens
    moved: int = 0  # sequences moved to another holder of a span
    wait_ms: dict[str, float] = field(default_factory=dict)  # span -> summed job round trips


class Chain:
    """Runs a stage-grain model's blocks for the engine (`forward`), over stage holders."""

    def __init__(
        self, head: Backbone, info: ModelInfo, coord: str, routing: SliceRouter,
        mailbox: Mailbox, stats: DispatchCounters, deadline_ms: int, replica_wait_s: float,
    ) -> None:  # fmt: skip
        self.head, self.info, self.coord, self.routing, self.mailbox = (
            head, info, coord, routing, mailbox
        )  # fmt: skip
        self.stages: list[SliceSpec] = info.stages()
        self.dispatch_stats = stats
        self.deadline_ms, self.replica_wait_s = deadline_ms, replica_wait_s
        self._seqs: weakref.WeakKeyDictionary[KVCache, _Seq] = weakref.WeakKeyDictionary()
        self._keys = itertools.count()
        self._gone: list[_Seq] = []  # finished sequences whose holders still keep state
        self._drops: dict[str, list[str]] = {}  # worker -> keys to drop with its next job
        self.stats = ChainStats()

    # -- the engine's side ---------------------------------------------------------------
    def new_cache(self) -> KVCache:
        """A sequence's cache on the coordinator: no block is held here, so it only counts
        positions; the chain's record of the sequence lives as long as it does."""
        cache = self.head.new_cache()
        seq = _Seq(f"s{next(self._keys)}")
        self._seqs[cache] = seq
        weakref.finalize(cache, self._gone.append, seq)
        return cache

    @torch.no_grad()
    def forward(self, steps: list[SeqStep]) -> torch.Tensor:
        """Logits [len(steps), V] at each sequence's last new token, the blocks run by the
        stage holders; caches advance only when every span has answered."""
        lens = self.head.check_steps(steps)
        h = self.head.embed_tokens([t for s in steps for t in s.tokens])  # [N, H]
        rows, at = [], 0
        for s, n in zip(steps, lens, strict=True):
            rows.append(_Rows(self._seqs[s.cache], list(s.tokens), h[at : at + n], s.cache.length))
            at += n
        self._release_finished()
        for k in range(len(self.stages)):
            self._span(k, rows)
        out = torch.cat([r.x for r in rows])  # replayed sequences carry all their rows
        logits = self.head.head(out, [int(r.x.shape[0]) for r in rows])
        Backbone.advance(steps)
        for r in rows:
            r.seq.fed.extend(r.tokens)
        return logits

    # -- one span ------------------------------------------------------------------------
    def _span(self, k: int, rows: list[_Rows]) -> None:
        """Run span `k` over `rows`, moving and replaying whatever fails, until every row
        has passed it (or NoReplica)."""
        until = time.monotonic() + self.replica_wait_s
        sid = self.stages[k].sid
        todo = rows
        while todo:
            bad = self._send_and_wait(k, todo, until)
            if not bad.reasons:
                return
            log.warning("stage %s: %s; replaying %d sequence(s)", sid, "; ".join(bad.reasons),
                        len(bad.replay))  # fmt: skip
            for r, holder in bad.replay:
                if holder is None:
                    r.seq.holders.pop(sid, None)
                    self.stats.moved += 1
                else:
                    r.seq.holders[sid] = holder
            again = [r for r, _ in bad.replay]
            self._replay(again, k)
            todo = again + bad.resend
            if time.monotonic() >= until:
                raise NoReplica(f"model {self.info.model!r}: stage {sid} failed for "
                                f"{self.replica_wait_s:g} s (KVQ_REPLICA_WAIT_S): "
                                f"{'; '.join(bad.reasons)}")  # fmt: skip

    def _replay(self, rows: list[_Rows], k: int) -> None:
        """Rebuild the state of `rows`' sequences: all their tokens from position 0 through
        spans 0..k-1 (span k runs them next)."""
        for r in rows:
            r.x, r.start = self.head.embed_tokens(r.seq.fed + r.tokens), 0
            self.stats.replays += 1
        for j in range(k):
            self._span(j, rows)

    def _send_and_wait(self, k: int, rows: list[_Rows], until: float) -> _Outcome:
        """One job per holder of span `k` for `rows`, then their answers into `rows`; what
        failed comes back in the outcome (the answered rows have passed the span)."""
        spec = self.stages[k]
        by_worker: dict[str, list[_Rows]] = {}
        for r in rows:
            w = r.seq.holders.get(spec.sid) or self._pick(spec.sid, until)
            r.seq.holders[spec.sid] = w
            by_worker.setdefault(w, []).append(r)
        sent: dict[str, tuple[str, list[_Rows]]] = {}  # job id -> (worker, rows)
        posts: list[tuple[str, Fields]] = []
        for w, group in sorted(by_worker.items()):
            job_id = self.mailbox.next_job_id()
            job = wire.StageJob(
                job_id=job_id, model=self.info.model, slice=spec.sid, coord=self.coord,
                reply_to=self.mailbox.results_key(w), deadline_ms=0,
                seqs=[wire.StageSeq(r.seq.key, r.start, int(r.x.shape[0])) for r in group],
                x=wire.Tensor.of(torch.cat([r.x for r in group]).float().contiguous().numpy()),
                drop=self._drops.pop(w, [])[: wire.MAX_STAGE_SEQS],
            )  # fmt: skip
            n = sum(int(r.x.shape[0]) for r in group)
            p = Pending(spec, torch.arange(n), w, time.monotonic(), time.time() * 1000)
            self.mailbox.expect(job_id, p, self)
            sent[job_id] = (w, group)
            posts.append((w, wire.encode(job)))
        self.mailbox.post(posts, watch=self.routing.live_holders(spec.sid))
        self.stats.stage_jobs += len(posts)
        return self._collect(spec, sent)

    def _collect(self, spec: SliceSpec, sent: dict[str, tuple[str, list[_Rows]]]) -> _Outcome:
        """Every answer to `sent`, or the reason it will not come (holder down, deadline)."""
        t0 = time.monotonic()
        deadline = t0 + self.deadline_ms / 1000
        out = _Outcome()
        while sent:
            for dv in self.mailbox.collect(self, _POLL_MS):
                worker, group = sent.pop(dv.job_id)
                ms = latency_ms(dv.pending, dv.eid)
                self.stats.wait_ms[spec.sid] = self.stats.wait_ms.get(spec.sid, 0.0) + ms
                why = self._take(group, dv.result, dv.sender, out)
                if why:
                    out.reasons.append(why)
                    self.routing.observe_failure(dv.sender, ms)
                else:
                    self.routing.observe_result(dv.sender, ms)
            if not sent:
                break
            self.routing.refresh()
            live = set(self.routing.live_holders(spec.sid))
            late = time.monotonic() > deadline
            for job_id, (worker, group) in list(sent.items()):
                if worker in live and not late:
                    continue
                del sent[job_id]
                self.mailbox.forget(job_id)
                self.routing.observe_failure(worker, (time.monotonic() - t0) * 1000)
                why = "its holder is down" if worker not in live else "no answer in time"
                out.reasons.append(f"job {job_id} to {worker}: {why}")
                out.replay.extend((r, None) for r in group)
        return out

    def _take(self, group: list[_Rows], res: wire.Result, sender: str, out: _Outcome) -> str:
        """Rows of an answer into `group` (""), or why not, with the rows put in `out`."""
        if res.error is not None:
            if res.error.type == STATE_LOST:  # refused whole: nothing ran
                lost = set(res.lost)
                out.replay.extend((r, sender) for r in group if r.seq.key in lost)
                out.resend.extend(r for r in group if r.seq.key not in lost)
            else:
                out.replay.extend((r, None) for r in group)
            return f"{sender}: {res.error.type}: {res.error.message}"
        n = sum(int(r.x.shape[0]) for r in group)
        y = res.y.array() if res.y is not None else None
        if y is None or y.shape != (n, self.head.meta.embedding_length) or not np.isfinite(y).all():
            out.replay.extend((r, None) for r in group)
            return f"{sender} answered rows of shape {None if y is None else y.shape}"
        rows = torch.from_numpy(np.array(y, dtype=np.float32)).to(self.head.dtype)
        at = 0
        for r in group:
            m = int(r.x.shape[0])
            r.x = rows[at : at + m]  # the same positions enter the next span
            at += m
        return ""

    def _pick(self, sid: str, until: float) -> str:
        """The cheapest live holder of `sid` (H3 cost, then this coordinator's sequences
        there, then id); waits for one until `until`, then NoReplica."""
        while True:
            live = self.routing.live_holders(sid)
            if live:
                here = self._load(sid)
                return min(live, key=lambda w: (self._cost(w), here.get(w, 0), w))
            if time.monotonic() >= until:
                raise NoReplica(
                    f"model {self.info.model!r}: no live worker holds stage {sid}; waited "
                    f"{self.replica_wait_s:g} s (KVQ_REPLICA_WAIT_S). Start workers (kvq "
                    "worker) with room for the model's stage slices, then send the request again"
                )
            time.sleep(max(0.02, min(0.5, self.routing.refresh_s)))
            self.routing.refresh(force=True)

    def _cost(self, worker: str) -> float:
        try:
            return self.routing.router.state.node_cost(worker)
        except (RoutingError, KeyError):
            return float("inf")

    def _load(self, sid: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for seq in self._seqs.values():
            w = seq.holders.get(sid)
            if w is not None:
                out[w] = out.get(w, 0) + 1
        return out

    def _release_finished(self) -> None:
        """Queue the finished sequences' keys for their holders' next jobs."""
        gone, self._gone = self._gone, []
        for seq in gone:
            for w in set(seq.holders.values()):
                self._drops.setdefault(w, []).append(seq.key)
