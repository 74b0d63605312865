"""Graded trust in workers: how often a worker's results are recomputed, and what a lie costs it.

A coordinator recomputes a sampled share of each worker's results before using them (X3,
`docs/security.md`, "Verified results and trust"). The share is a schedule of the worker's
*clean streak* `ok` (results verified equal since its last mismatch):

    p(ok) = 1                                   while ok < full_checks
    p(ok) = max(p_min, decay ** (ok - full_checks))   after

A mismatch (or a non-finite result) resets the streak to 0, so the next results are checked
again with p = 1, quarantines the worker for `quarantine_s` (its results are not used, it gets
no work) and, at the `ban_after`-th mismatch, bans its id for good.

Why the bound holds: at a worker's i-th job (from 0) its streak is at most i, and the schedule
never rises with the streak, so that job is checked with probability >= p(i) whatever happened
before. A worker that returns garbage on a share g of its jobs, independently of being checked
(it cannot know), escapes detection for n jobs with probability <= prod_{i<n} (1 - g p(i));
`catch_probability` is 1 minus that product. The defaults give 0.99923 for g = 0.1 within 100
jobs (and 1 for g = 1: its first job is checked), at a steady cost of p_min = 2% of remote rows.

Trust that cannot be banked: a worker honest for a long streak sits at p_min, so a liar that
starts late would have about 1/p_min = 50 of its lies used before the first check, spread over
several requests. The *step floor* bounds that per engine step instead of per job: each job of
a worker that got `n` jobs per step (a running average) is checked with probability at least
`1 - (1 - step_floor) ** (1 / n)`, so in every step where a worker lies on all its jobs, at
least one is checked with probability `step_floor` (0.3 by default), whatever its history. A
request of T tokens then catches a liar that turns within it with probability
`1 - (1 - step_floor) ** T` (0.986 at 12 tokens). The cost, once trusted, is about
`-ln(1 - step_floor) = 0.36` checked jobs per worker per step: 36% of the remote rows of a
worker with one job per step (the tiny test models), under p_min for one with 18 or more (a
real model's worker holds slices on many layers).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvq.bus.records import Quarantine
from kvq.settings_parts import DispatchSettings


@dataclass(frozen=True, slots=True)
class TrustPolicy:
    """The check schedule and the penalties (settings `KVQ_TRUST_*`)."""

    full_checks: int = 50  # results checked with p = 1 before sampling starts to fall
    decay: float = 0.95  # p falls by this factor per further verified result
    p_min: float = 0.02  # the floor: the steady share of a trusted worker's results recomputed
    quarantine_s: float = 600.0  # how long a caught worker gets no work
    ban_after: int = 3  # the mismatch that bans the id for good
    step_floor: float = 0.3  # P(at least one of a worker's jobs in a step is checked)

    def p(self, ok: int) -> float:
        """Check probability of a worker whose clean streak is `ok` results."""
        if ok < self.full_checks:
            return 1.0
        return max(self.p_min, self.decay ** (ok - self.full_checks))

    def per_job(self, jobs_per_step: float) -> float:
        """The check probability per job that makes a step of `jobs_per_step` jobs checked at
        least once with probability `step_floor`."""
        return float(1.0 - (1.0 - self.step_floor) ** (1.0 / max(1.0, jobs_per_step)))


def trust_policy(s: DispatchSettings) -> TrustPolicy:
    return TrustPolicy(
        s.trust_full_checks,
        s.trust_decay,
        s.trust_p_min,
        s.trust_quarantine_s,
        s.trust_ban_after,
        s.trust_step_floor,
    )


def catch_probability(policy: TrustPolicy, garbage: float, jobs: int) -> float:
    """Lower bound on P(a worker lying on a share `garbage` of its jobs is caught within `jobs`
    of them): 1 - prod_{i<jobs} (1 - garbage * p(i)), the exact product of the schedule."""
    escape = 1.0
    for i in range(jobs):
        escape *= 1.0 - garbage * policy.p(i)
    return 1.0 - escape


@dataclass(slots=True)
class WorkerTrust:
    """What this coordinator knows of one worker."""

    ok: int = 0  # verified results since its last mismatch
    checked: int = 0
    mismatches: int = 0
    until_ms: float = 0.0  # quarantined until then
    banned: bool = False
    drained: bool = False  # an operator's drain: no new work, its results still used
    decided_ms: float = 0.0  # the last verdict's time: an older operator's word does not undo it


class Trust:
    """Per-worker trust of one coordinator, merged with the verdicts recorded in Redis.

    `rng` decides which results are checked: unpredictable by default (a worker that could
    predict the draws would lie only when unchecked); tests pass a seeded one."""

    def __init__(
        self,
        policy: TrustPolicy,
        coord: str,
        rng: random.Random | None = None,
        clock_ms: Callable[[], float] = lambda: time.time() * 1000,
    ) -> None:
        self.policy, self.coord = policy, coord
        self.rng = rng if rng is not None else random.SystemRandom()
        self.clock_ms = clock_ms
        self.workers: dict[str, WorkerTrust] = {}
        self.verdicts: dict[str, Quarantine] = {}  # the last one this coordinator published
        # jobs per engine step of each worker: a running average over the steps it had jobs
        # in, and the count of the current step; empty until `new_step` is first called
        self.per_step: dict[str, float] = {}
        self.this_step: dict[str, int] = {}
        self.counting = False

    def _of(self, worker: str) -> WorkerTrust:
        return self.workers.setdefault(worker, WorkerTrust())

    def p(self, worker: str) -> float:
        """The check probability of `worker`'s next result: its streak's, raised to the step
        floor's share once this coordinator counts steps."""
        p = self.policy.p(self._of(worker).ok)
        n = self.per_step.get(worker)
        return p if n is None else max(p, self.policy.per_job(n))

    def new_step(self) -> None:
        """An engine step begins: fold the last step's job counts into the running average."""
        self.counting = True
        done, self.this_step = self.this_step, {}
        for worker, n in done.items():
            old = self.per_step.get(worker)
            self.per_step[worker] = float(n) if old is None else 0.8 * old + 0.2 * n

    def should_check(self, worker: str) -> bool:
        """Draw whether this result of `worker` is recomputed before it is used."""
        self.this_step[worker] = self.this_step.get(worker, 0) + 1
        if self.counting and worker not in self.per_step:
            self.per_step[worker] = 1.0  # until measured: one job per step, the strictest
        p = self.p(worker)
        return p >= 1.0 or self.rng.random() < p

    def barred(self, worker: str) -> bool:
        """Quarantined now, or banned: its results are not used and it gets no work."""
        t = self.workers.get(worker)
        return t is not None and (t.banned or t.until_ms > self.clock_ms())

    def idle(self, worker: str) -> bool:
        """Gets no new work: barred, or drained by an operator."""
        t = self.workers.get(worker)
        return self.barred(worker) or (t is not None and t.drained)

    def passed(self, worker: str) -> None:
        t = self._of(worker)
        t.ok += 1
        t.checked += 1

    def failed(self, worker: str, reason: str) -> Quarantine:
        """A mismatch: the streak restarts, the worker is quarantined (or banned); returns the
        record to publish."""
        t = self._of(worker)
        t.ok = 0
        t.checked += 1
        t.mismatches += 1
        now = self.clock_ms()
        t.until_ms = now + self.policy.quarantine_s * 1000
        t.banned = t.banned or t.mismatches >= self.policy.ban_after
        t.decided_ms = float(int(now))  # as its verdict says: an operator within the ms wins
        verdict = Quarantine(
            until_ms=int(t.until_ms),
            mismatches=t.mismatches,
            banned=t.banned,
            coord=self.coord,
            reason=reason[:300],
            ts_ms=int(now),
        )
        self.verdicts[worker] = verdict
        return verdict

    def lost(self, records: Mapping[str, Quarantine]) -> dict[str, Quarantine]:
        """This coordinator's verdicts still in force that `records` (the board's) lacks:
        Redis lost them, and they are published again."""
        now = self.clock_ms()
        return {
            w: q
            for w, q in self.verdicts.items()
            if w not in records and (q.banned or q.until_ms > now)
        }

    def merge(self, records: Mapping[str, Quarantine]) -> None:
        """Verdicts any coordinator of the model recorded: the strictest of both views wins."""
        for worker, q in records.items():
            t = self._of(worker)
            if q.operator and q.ts_ms >= t.decided_ms:  # an operator's word, as said
                t.until_ms, t.banned, t.drained = float(q.until_ms), q.banned, q.drain
                t.decided_ms = float(q.ts_ms)
                t.mismatches = max(t.mismatches, q.mismatches)
                self.verdicts.pop(worker, None)  # overruled: not published again
                continue
            if q.mismatches > t.mismatches:
                t.ok = 0  # caught elsewhere since we last checked it: check it fully again
                t.mismatches = q.mismatches
            t.until_ms = max(t.until_ms, float(q.until_ms))
            t.banned = t.banned or q.banned

    def describe(self) -> dict[str, dict[str, float | int | bool]]:
        return {
            w: {
                "p": round(self.policy.p(t.ok), 4),
                "ok": t.ok,
                "mismatches": t.mismatches,
                "barred": self.barred(w),
                "banned": t.banned,
            }
            for w, t in sorted(self.workers.items())
        }
