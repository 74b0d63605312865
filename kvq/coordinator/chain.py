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

A holder that also holds the next spans of all a job's sequences runs them in the same job
(`StageJob.then`): one round trip for consecutive spans in one place. `start` opens a pass of
some sequences and `pump` carries every open pass on until one is done: the engine keeps one
pass per cohort open (`KVQ_MICROBATCHES`), so a cohort goes on to its next step while the
others are still on their way and every holder can compute all the time.

Finished sequences are forgotten by their holders through the next job sent to each (`drop`),
found when the engine lets go of their caches.

Answers are checked per sequence and span (X3, `kvq.coordinator.stage_check`): a sequence drawn
when it enters a span is witnessed there by a second holder, which gets the same jobs; the rows
go on only when both answers agree, and on disagreement the coordinator's own run of the span
decides who lied. A holder caught lying gets no more work; its sequences move and replay.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

from kvq import wire
from kvq.bus.board import Fields
from kvq.catalog import ModelInfo
from kvq.coordinator.chain_rows import ChainSeq, InFlight, Pair, Rows
from kvq.coordinator.chain_rows import Pass as Pass  # the engine's handle on a pass
from kvq.coordinator.chain_witness import WitnessSteps
from kvq.coordinator.layer_call import Tally
from kvq.coordinator.mailbox import Mailbox
from kvq.coordinator.pending import Answer, latency_ms
from kvq.coordinator.routing import SliceRouter
from kvq.coordinator.stage_check import Referee
from kvq.coordinator.verify import Verifier
from kvq.errors import NoReplica
from kvq.model import Backbone, KVCache, SeqStep
from kvq.slices import SliceSpec
from kvq.swarm.telemetry import hops_cost

log = logging.getLogger("kvq.coordinator")
_POLL_MS = 50  # a wait for stage answers rereads the holders' liveness this often


class Chain(WitnessSteps):
    """Runs a stage-grain model's blocks for the engine (`forward`), over stage holders."""

    def __init__(
        self,
        head: Backbone,
        info: ModelInfo,
        coord: str,
        routing: SliceRouter,
        mailbox: Mailbox,
        tally: Tally,
        deadline_ms: int,
        replica_wait_s: float,
        cohorts: int = 1,
        verifier: Verifier | None = None,
        referee: Referee | None = None,
        clock_ms: Callable[[], float] = lambda: time.time() * 1000,
    ) -> None:
        """Counts go into `tally` as the expert dispatch's do (remote jobs, rows, waits, the
        round-trip histogram), with the replays and moves. `verifier` draws and records the
        checks (None: none), `referee` decides disagreements. `clock_ms`: Redis's clock
        (`Board.now_ms`), which a result's entry id is compared with."""
        self.head, self.info, self.coord, self.routing, self.mailbox = (
            head,
            info,
            coord,
            routing,
            mailbox,
        )
        self.stages: list[SliceSpec] = info.stages()
        self.verifier, self.clock_ms = verifier, clock_ms
        self.referee = referee if referee is not None else Referee(None, self.stages)
        self.stats, self.job_rtt = tally.stats, tally.job_rtt
        self.wait_s: dict[str, float] = {}  # span -> seconds waited for its answers
        self.deadline_ms, self.replica_wait_s = deadline_ms, replica_wait_s
        self.cohorts = cohorts  # KVQ_MICROBATCHES: passes the engine keeps open at once
        self._cohorts = itertools.count()  # each pass's rows travel as their own jobs
        self._passes: list[Pass] = []
        self._flying: dict[str, InFlight] = {}
        self._until = 0.0  # NoReplica after this long without an answer used
        self._seqs: weakref.WeakKeyDictionary[KVCache, ChainSeq] = weakref.WeakKeyDictionary()
        self._keys = itertools.count()
        self._gone: list[ChainSeq] = []  # finished sequences whose holders still keep state
        self._drops: dict[str, list[str]] = {}  # worker -> keys to drop with its next job

    def wait_text(self) -> str:
        """The seconds waited per span, as JSON (`CoordStats.stage_wait_s`)."""
        waits = dict(self.wait_s)  # read on the slot-poll thread: one atomic copy first
        return json.dumps({sid: round(s, 3) for sid, s in waits.items()})

    # -- the engine's side ---------------------------------------------------------------
    def new_cache(self) -> KVCache:
        """A sequence's cache on the coordinator: no block is held here, so it only counts
        positions; the chain's record of the sequence lives as long as it does."""
        cache = self.head.new_cache()
        seq = ChainSeq(f"s{next(self._keys)}")
        self._seqs[cache] = seq
        weakref.finalize(cache, self._gone.append, seq)
        return cache

    def start(self, steps: list[SeqStep]) -> Pass:
        """Begin a pass of `steps` (its rows wait to be sent); `pump` carries it on."""
        lens = self.head.check_steps(steps)
        h = self.head.embed_tokens([t for s in steps for t in s.tokens])  # [N, H]
        cohort = next(self._cohorts)
        rows, at = [], 0
        for s, n in zip(steps, lens, strict=True):
            seq = self._seqs[s.cache]
            rows.append(Rows(seq, list(s.tokens), h[at : at + n], s.cache.length, cohort))
            at += n
        p = Pass(steps, rows)
        self._passes.append(p)
        if self.verifier is not None:
            self.verifier.trust.new_step()  # the step floor of checks counts draws per step
        if len(self._passes) == 1:
            self._until = time.monotonic() + self.replica_wait_s
        return p

    @torch.no_grad()
    def pump(self) -> list[tuple[Pass, torch.Tensor]]:
        """Send what waits, read answers, until some pass has left the last span; returns
        each finished pass with its logits [len(steps), V] (its caches advanced). A pass
        goes on to the next span as soon as its answer is in, while the others compute:
        with several passes open (cohorts, `kvq.coordinator.engine`) every holder works."""
        self._release_finished()
        last = len(self.stages)
        while True:
            ready = [r for p in self._passes for r in p.rows if not r.busy and r.next < last]
            if ready:
                self._send(ready, self._flying, self._until)
            if self._receive(self._flying):
                self._until = time.monotonic() + self.replica_wait_s
            elif time.monotonic() > self._until:
                self._passes, self._flying = [], {}
                raise NoReplica(
                    f"model {self.info.model!r}: no stage answer for "
                    f"{self.replica_wait_s:g} s (KVQ_REPLICA_WAIT_S)"
                )
            done = [p for p in self._passes if all(r.next >= last for r in p.rows)]
            if done:
                self._passes = [p for p in self._passes if p not in done]
                return [(p, self._finish(p)) for p in done]

    @torch.no_grad()
    def forward(self, steps: list[SeqStep]) -> torch.Tensor:
        """Logits [len(steps), V] at each sequence's last new token, the blocks run by the
        stage holders; caches advance only when every span has answered."""
        p = self.start(steps)
        while True:
            for q, logits in self.pump():
                if q is p:
                    return logits

    def abandon(self) -> None:
        """Drop every open pass (its sequences failed): their answers are not waited for."""
        for job_id in self._flying:
            self.mailbox.forget(job_id)
        self._passes, self._flying = [], {}

    def _finish(self, p: Pass) -> torch.Tensor:
        out = torch.cat([r.x for r in p.rows])  # replayed sequences carry all their rows
        logits = self.head.head(out, [int(r.x.shape[0]) for r in p.rows])
        Backbone.advance(p.steps)
        for r in p.rows:
            r.seq.fed.extend(r.tokens)
        return logits

    def _send(self, ready: list[Rows], flying: dict[str, InFlight], until: float) -> None:
        """One job per (cohort, span, holder, witness) of the ready rows: over the spans that
        follow on that holder for all of its rows where none is witnessed, else the same
        job to the witness too."""
        t0 = time.perf_counter()
        groups: dict[tuple[int, int, str, str], list[Rows]] = {}
        for r in ready:
            self._check_holders(r)
            w = self._holder(r, r.next, until)
            v = self._witness(r, r.next, w) or ""
            groups.setdefault((r.cohort, r.next, w, v), []).append(r)
        posts: list[tuple[str, Fields]] = []
        now = time.monotonic()
        for (_, k, w, v), group in sorted(groups.items()):
            spans = [k] if v else self._spans_on(w, group, k, until)
            pair = Pair(group, k, [r.x for r in group], w, v) if v else None
            for worker in (w, v) if v else (w,):
                job_id = self.mailbox.next_job_id()
                posts.append((worker, self._encode(job_id, worker, group, spans)))
                flying[job_id] = InFlight(worker, group, spans, now, pair)
            for r in group:
                r.busy = True
            self.stats.witness_jobs += bool(v)
        self.mailbox.post(posts, watch=[w for _, w in sorted({(0, w) for w, _ in posts})])
        self.stats.remote_sent += len(posts)
        self.stats.remote_send_s += time.perf_counter() - t0

    def _spans_on(self, w: str, group: list[Rows], k: int, until: float) -> list[int]:
        """Span `k` and those after it that `w` holds for every row of `group`, none of
        them witnessed."""
        spans = [k]
        while spans[-1] + 1 < len(self.stages) and all(
            self._holder(r, spans[-1] + 1, until) == w and not self._witness(r, spans[-1] + 1, w)
            for r in group
        ):
            spans.append(spans[-1] + 1)
        return spans

    def _encode(self, job_id: str, worker: str, group: list[Rows], spans: list[int]) -> Fields:
        seqs = [wire.StageSeq(r.seq.key, r.start, int(r.x.shape[0])) for r in group]
        return self._stage_job(
            job_id,
            worker,
            self.stages[spans[0]],
            seqs,
            torch.cat([r.x for r in group]),
            drop=self._drops.pop(worker, [])[: wire.MAX_STAGE_SEQS],
            then=[self.stages[k].sid for k in spans[1:]],
        )

    def _receive(self, flying: dict[str, InFlight]) -> bool:
        """One read of the answers (a short block), then the jobs whose holder is down or
        whose deadline passed given up. True if some answer was used."""
        t0 = time.perf_counter()
        used = False
        for dv in self.mailbox.collect(self, _POLL_MS):
            job = flying.pop(dv.job_id)
            ms = latency_ms(dv.pending, dv.eid)
            self.job_rtt.observe(ms / 1000)
            why = self._take(job, dv.result, dv.sender, flying)
            if why:
                self.stats.remote_errors += 1
                self.routing.observe_failure(dv.sender, ms)
                log.warning("%s: %s", self._span_names(job), why)
            else:
                used = True
                self.stats.remote_jobs += 1
                self.stats.remote_rows += sum(int(r.x.shape[0]) for r in job.rows)
                self.routing.observe_result(dv.sender, ms)
            self._count_wait(job)
        self.routing.refresh()
        now = time.monotonic()
        for job_id, job in list(flying.items()):
            down = job.worker not in self.routing.live_holders(self.stages[job.spans[0]].sid)
            if not down and now - job.sent_at <= self.deadline_ms / 1000:
                continue
            del flying[job_id]
            self.mailbox.forget(job_id)
            self.routing.observe_failure(job.worker, (now - job.sent_at) * 1000)
            why = "its holder is down" if down else f"no answer in {self.deadline_ms} ms"
            log.warning("%s: job %s to %s: %s", self._span_names(job), job_id, job.worker, why)
            self._failed(job, flying)
            self._count_wait(job)
        self.stats.remote_wait_s += time.perf_counter() - t0
        return used

    def _take(
        self, job: InFlight, res: wire.Result, sender: str, flying: dict[str, InFlight]
    ) -> str:
        """The answer's rows into the job's rows (""), or why not, with the rows set to
        replay or to be sent again. A witnessed group's rows wait for both answers."""
        if job.replay >= 0:
            return self._take_replay(job, res, sender)
        y, why = self._answer(job, res, sender)
        if y is None:
            lost = res.error is not None and res.error.type == wire.STATE_LOST
            if lost and job.pair is None:  # refused whole: nothing ran
                keys = set(res.lost)
                self._replay(job.spans, [r for r in job.rows if r.seq.key in keys], sender)
                for r in job.rows:
                    r.busy = False  # the others go again as they were
            else:
                self._failed(job, flying)
            return why
        if job.pair is None:
            self._apply(job.rows, job.spans[-1], y)
            return ""
        job.pair.answers[job.worker] = Answer(job.worker, y, res.dtype, res.numerics)
        return self._resolve(job.pair)

    def _answer(
        self, job: InFlight, res: wire.Result, sender: str
    ) -> tuple[torch.Tensor | None, str]:
        """The rows of a well-formed, finite answer, or None and why."""
        if res.error is not None:
            return None, f"{sender}: {res.error.type}: {res.error.message}"
        n = sum(int(r.x.shape[0]) for r in job.rows)
        y = res.y.array() if res.y is not None else None
        if y is None or y.shape != (n, self.head.meta.embedding_length) or not np.isfinite(y).all():
            return None, f"{sender} answered rows of shape {None if y is None else y.shape}"
        return torch.from_numpy(np.array(y, dtype=np.float32)).to(self.head.dtype), ""

    def _failed(self, job: InFlight, flying: dict[str, InFlight]) -> None:
        """`job` failed (an error, its holder down, no answer in time): a witness's leaves
        the holder's answer unconfirmed; a holder's sends its rows back to position 0 (the
        witness's twin, if any, is dropped with it)."""
        pair = job.pair
        if job.replay >= 0:
            self.stats.unresolved += 1
            raise NoReplica(
                f"stage {self.stages[job.spans[0]].sid}: the third holder "
                f"{job.worker} asked to decide between two answers failed; no "
                "answer is used"
            )
        if pair is not None and job.worker == pair.witness:
            self._unwitness(pair)
            self._resolve(pair)
            return
        if pair is not None:
            for job_id, other in list(flying.items()):
                if other.pair is pair:
                    del flying[job_id]
                    self.mailbox.forget(job_id)
        self._replay(job.spans, job.rows, keep=None)

    def _replay(self, spans: list[int], rows: list[Rows], keep: str | None) -> None:
        """Rebuild the state of `rows`' sequences: all their tokens again from position 0,
        through every span; `spans` go to `keep` (it holds them: `StateLost`) or to
        whichever live holder is cheapest when they get there (None: their holder
        failed)."""
        for r in rows:
            for k in spans:
                sid = self.stages[k].sid
                if keep is None:
                    r.seq.holders.pop(sid, None)
                    self.stats.stage_moves += 1
                else:
                    r.seq.holders[sid] = keep
            r.x, r.start, r.next, r.busy = self.head.embed_tokens(r.seq.fed + r.tokens), 0, 0, False
            self.stats.stage_replays += 1

    def _check_holders(self, r: Rows) -> None:
        """A row whose holder of its next span is no longer live (dead, caught) replays
        from position 0 now, its spans on that holder moved, instead of being sent there."""
        if r.next >= len(self.stages):
            return
        w = r.seq.holders.get(self.stages[r.next].sid)
        if w is None or w in self.routing.live_holders(self.stages[r.next].sid):
            return
        gone = [k for k, spec in enumerate(self.stages) if r.seq.holders.get(spec.sid) == w]
        log.warning(
            "stage %s: holder %s is gone; sequence %s moves and replays",
            self.stages[r.next].sid,
            w,
            r.seq.key,
        )
        self._replay(gone, [r], keep=None)

    def _count_wait(self, job: InFlight) -> None:
        sid = self.stages[job.spans[0]].sid
        self.wait_s[sid] = self.wait_s.get(sid, 0.0) + time.monotonic() - job.sent_at

    def _span_names(self, job: InFlight) -> str:
        return "stage " + "+".join(self.stages[k].sid for k in job.spans)

    def _holder(self, r: Rows, k: int, until: float) -> str:
        """The holder of span `k` for `r`'s sequence: its own while it has one, else the
        cheapest live one, a hop saved where the previous span's holder has it too (H3)."""
        sid = self.stages[k].sid
        w = r.seq.holders.get(sid)
        if w is None:
            prev = r.seq.holders.get(self.stages[k - 1].sid) if k else None
            w = r.seq.holders[sid] = self._pick(k, prev, until)
        return w

    def _pick(self, k: int, prev: str | None, until: float) -> str:
        """The cheapest live holder of span `k`: H3's node cost, plus a hop unless it is
        `prev` (the holder of the span before), less a hop for each span after `k` it holds
        too (a chain of fewer hops), then this coordinator's sequences there, then id; waits
        for one until `until`, then NoReplica."""
        hop = hops_cost(1, self.routing.router.policy.weights)
        sid = self.stages[k].sid
        while True:
            live = self.routing.live_holders(sid)
            if live:
                runs = {w: self._run_after(w, k) for w in live}
                return cheapest_holder(live, self._cost, hop, prev, runs, self._load(sid))
            if time.monotonic() >= until:
                raise NoReplica(
                    f"model {self.info.model!r}: no live worker holds stage {sid}; waited "
                    f"{self.replica_wait_s:g} s (KVQ_REPLICA_WAIT_S). Start workers (kvq "
                    "worker) with room for the model's stage slices, then send the request again"
                )
            time.sleep(max(0.02, min(0.5, self.routing.refresh_s)))
            self.routing.refresh(force=True)

    def _run_after(self, worker: str, k: int) -> int:
        """How many spans right after `k` `worker` holds too (its job could run them all)."""
        n = 0
        while k + n + 1 < len(self.stages) and worker in self.routing.live_holders(
            self.stages[k + n + 1].sid
        ):
            n += 1
        return n

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


def cheapest_holder(
    live: list[str],
    cost: Callable[[str], float],
    hop: float,
    prev: str | None,
    runs: dict[str, int],
    here: dict[str, int],
) -> str:
    """The holder a sequence takes for a span: least node `cost`, plus `hop` unless it is
    `prev` (the previous span's holder), less `hop` for each of the `runs[w]` spans after
    this one that `w` holds too (a chain of fewer hops); then fewest of this coordinator's
    sequences (`here`), then id."""
    return min(live, key=lambda w: (cost(w) + hop * ((w != prev) - runs[w]), here.get(w, 0), w))
