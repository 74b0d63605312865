"""Witnessed sequences at stage grain (X3, X12): the steps of `kvq.coordinator.chain.Chain`
that draw a second holder for a sequence entering a span, compare the two answers, and on a
disagreement have the coordinator's own file (`kvq.coordinator.stage_check.Referee`) or a third
live holder replay the sequence's rows to decide who lied.

`WitnessSteps` is `Chain`'s base: the chain's state it reads is declared here, and the three
chain steps it calls (`_apply`, `_failed`, `_cost`) are the chain's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from kvq import wire
from kvq.bus.board import Fields
from kvq.bus.records import DispatchCounters
from kvq.catalog import ModelInfo
from kvq.coordinator.chain_rows import InFlight, Pair, Rows
from kvq.coordinator.mailbox import Mailbox
from kvq.coordinator.pending import Answer, Pending
from kvq.coordinator.routing import SliceRouter
from kvq.coordinator.stage_check import Referee, Ruling, decide, rule
from kvq.coordinator.verify import Verifier
from kvq.errors import NoReplica, RoutingError
from kvq.slices import SliceSpec

log = logging.getLogger("kvq.coordinator")


class WitnessSteps:
    """The witness and referee steps of a stage chain (see the module's text)."""

    info: ModelInfo
    coord: str
    routing: SliceRouter
    mailbox: Mailbox
    stages: list[SliceSpec]
    verifier: Verifier | None
    referee: Referee
    stats: DispatchCounters
    clock_ms: Callable[[], float]
    _flying: dict[str, InFlight]
    _drops: dict[str, list[str]]

    # the chain's own step for a failed job (`Chain._failed`)
    _failed: Callable[[InFlight, dict[str, InFlight]], None]

    def _apply(self, rows: list[Rows], last: int, y: torch.Tensor) -> None:
        """An answer's rows `y` into `rows`, which go on after span `last`."""
        at = 0
        for r in rows:
            m = int(r.x.shape[0])
            r.x, r.next, r.busy = y[at : at + m], last + 1, False
            at += m

    def _cost(self, worker: str) -> float:
        """H3's node cost of `worker` (infinite for one the router does not know)."""
        try:
            return self.routing.router.state.node_cost(worker)
        except (RoutingError, KeyError):
            return float("inf")

    def _stage_job(
        self,
        job_id: str,
        worker: str,
        spec: SliceSpec,
        seqs: list[wire.StageSeq],
        x: torch.Tensor,
        drop: list[str] | None = None,
        then: list[str] | None = None,
        chunks: list[int] | None = None,
    ) -> Fields:
        """Stage job `job_id` to `worker` for span `spec` over rows `x` (`wire.StageJob` says
        what `drop`, `then` and `chunks` are), awaited by this chain; encoded."""
        job = wire.StageJob(
            job_id=job_id,
            model=self.info.model,
            slice=spec.sid,
            coord=self.coord,
            reply_to=self.mailbox.results_key(worker),
            deadline_ms=0,
            seqs=seqs,
            x=wire.Tensor.of(x.float().contiguous().numpy()),
            drop=drop or [],
            then=then or [],
            chunks=chunks or [],
        )
        rows = torch.arange(int(x.shape[0]))
        p = Pending(spec, rows, worker, time.monotonic(), self.clock_ms())
        self.mailbox.expect(job_id, p, self)
        return wire.encode(job)

    def _unwitness(self, pair: Pair, lost: bool = True) -> None:
        """The pair's sequences go on unwitnessed on its span (`lost`: the witness failed)."""
        sid = self.stages[pair.span].sid
        for r in pair.rows:
            r.seq.witnesses.pop(sid, None)
            r.seq.chunks.pop(sid, None)
        pair.witness = None
        self.stats.unwitnessed += lost

    def _resolve(self, pair: Pair) -> str:
        """Both answers in: agreeing, the rows go on; disagreeing, the referee decides (and
        a step it cannot decide fails: NoReplica). One answer in: wait for the other."""
        a = pair.answers.get(pair.holder)
        b = pair.answers.get(pair.witness) if pair.witness is not None else None
        if a is None or (pair.witness is not None and b is None):
            return ""
        assert self.verifier is not None
        sid = self.stages[pair.span].sid
        if b is None:  # the witness failed: unconfirmed, as with no second holder
            self._apply(pair.rows, pair.span, a.y)
            return ""
        if not self.verifier.agree(a, b, exact=False):
            chunks = [
                self._history(r, sid) + [x] for r, x in zip(pair.rows, pair.inputs, strict=True)
            ]
            if self.referee.span(pair.span) is None:  # no copy here: a third holder replays
                self._ask_referee(pair, chunks)
            else:
                self._settle(pair, rule(self.verifier, self.referee, pair.span, a, b, chunks))
            return ""
        self.verifier.confirmed([a, b])
        for r, x in zip(pair.rows, pair.inputs, strict=True):
            r.seq.chunks[sid] = [*self._history(r, sid), x]
        self._apply(pair.rows, pair.span, a.y)
        return ""

    def _settle(self, pair: Pair, ruling: Ruling) -> None:
        """A disagreement decided: the answer agreed with goes on, its holder keeps the
        sequences (unwitnessed there from now on); undecided, the step fails."""
        if ruling.use is None:
            raise NoReplica(ruling.why)
        log.warning("%s: caught", ruling.why)
        for r in pair.rows:
            r.seq.holders[self.stages[pair.span].sid] = ruling.use.worker
        self._unwitness(pair, lost=False)
        self._apply(pair.rows, pair.span, ruling.use.y)

    def _ask_referee(self, pair: Pair, chunks: list[list[torch.Tensor]]) -> None:
        """Send each row group's inputs to the span since position 0 to a third live holder,
        as one replay each (`StageJob.chunks`: run as the two holders ran them)."""
        spec = self.stages[pair.span]
        asked = {pair.holder, pair.witness}
        free = [u for u in self.routing.live_holders(spec.sid) if u not in asked]
        if not free:
            self.stats.unresolved += 1
            raise NoReplica(
                f"stage {spec.sid}: {pair.holder} and {pair.witness} disagree, and "
                "neither this coordinator's file nor a third live holder of the span "
                "can decide; no answer is used"
            )
        u = pair.referee = min(free, key=lambda w: (self._cost(w), w))
        posts: list[tuple[str, Fields]] = []
        for i, (r, ch) in enumerate(zip(pair.rows, chunks, strict=True)):
            key = f"{r.seq.key}~referee"
            x = torch.cat(ch)
            job_id = self.mailbox.next_job_id()
            seqs = [wire.StageSeq(key, 0, int(x.shape[0]))]
            chunked = [int(c.shape[0]) for c in ch]
            posts.append((u, self._stage_job(job_id, u, spec, seqs, x, chunks=chunked)))
            self._flying[job_id] = InFlight(u, [r], [pair.span], time.monotonic(), pair, replay=i)
            self._drops.setdefault(u, []).append(key)
        self.mailbox.post(posts, watch=[u])
        self.stats.witness_jobs += len(posts)
        log.warning(
            "stage %s: %s and %s disagree; %s replays the rows to decide",
            spec.sid,
            pair.holder,
            pair.witness,
            u,
        )

    def _take_replay(self, job: InFlight, res: wire.Result, sender: str) -> str:
        """A referee's replay: its rows for the step (the last chunk's); when every row group
        is in, it decides between the two answers."""
        pair = job.pair
        assert pair is not None and self.verifier is not None
        r = job.rows[0]
        want = int(r.x.shape[0])
        y = res.y.array() if res.error is None and res.y is not None else None
        if y is None or y.shape[0] < want or not np.isfinite(y).all():
            self._failed(job, self._flying)  # raises NoReplica
        assert y is not None
        pair.replays[job.replay] = torch.from_numpy(np.array(y[-want:], dtype=np.float32))
        if len(pair.replays) < len(pair.rows):
            return ""
        a, b = pair.answers[pair.holder], pair.answers[str(pair.witness)]
        ref = torch.cat([pair.replays[i] for i in range(len(pair.rows))]).to(a.y.dtype)
        sid = self.stages[pair.span].sid
        judge = Answer(sender, ref, a.dtype, res.numerics)
        self._settle(pair, decide(self.verifier, sid, a, b, judge))
        return ""

    @staticmethod
    def _history(r: Rows, sid: str) -> list[torch.Tensor]:
        """The rows sent to span `sid` before this step's, since position 0."""
        return r.seq.chunks.get(sid, []) if r.start else []

    def _witness(self, r: Rows, k: int, w: str) -> str | None:
        """The second holder of span `k` that witnesses `r`'s sequence there: drawn when it
        enters the span at position 0 (the trust schedule of `w`), kept while it lives."""
        sid = self.stages[k].sid
        v = r.seq.witnesses.get(sid)
        live = self.routing.live_holders(sid)
        if v is not None and v != w and v in live:
            return v
        if v is not None:  # gone (or now the holder): unconfirmed from here on
            r.seq.witnesses.pop(sid)
            r.seq.chunks.pop(sid, None)
            self.stats.unwitnessed += 1
            return None
        if self.verifier is None or r.start or sid in r.seq.drawn:
            return None
        r.seq.drawn.add(sid)
        if not self.verifier.wants_witness(w):
            return None
        free = [u for u in live if u != w]
        if not free:
            self.stats.unwitnessed += 1
            return None
        v = r.seq.witnesses[sid] = min(free, key=lambda u: (self._cost(u), u))
        return v
