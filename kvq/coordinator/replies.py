"""`Replies`: what a coordinator writes back for its requests, each on the request's own reply
stream, and the acks of the request entries that are done.

One round trip per engine step: each sequence's new token, `done` for the finished ones, then
the acks of their entries (`ShardedConsumer.answer`). A refused request gets an `error` event
and its ack; a cancelled one its `done`. A restarted request (attempt > 1) replays the tokens
its reply stream already holds (`streamed_tokens`) without streaming them again.
"""

from __future__ import annotations

from kvq import wire
from kvq.bus.board import Fields
from kvq.bus.redis_board import RedisBoard
from kvq.bus.shards import ShardedConsumer
from kvq.coordinator.sequence import Sequence
from kvq.coordinator.telemetry import RequestTimes


def streamed_tokens(history: list[wire.ReplyEvent]) -> list[int]:
    """The token ids a request's reply stream already holds, index 0 onwards without a gap:
    what a new run of the request replays without streaming it again."""
    by_index: dict[int, int] = {}
    for ev in history:
        if ev.kind == "token" and ev.token_id is not None:
            by_index.setdefault(ev.index, ev.token_id)
    out: list[int] = []
    while len(out) in by_index:
        out.append(by_index[len(out)])
    return out


class Replies:
    """The reply events of the requests read through `requests`, with their counters."""

    def __init__(self, board: RedisBoard, requests: ShardedConsumer, times: RequestTimes) -> None:
        self.board, self.requests, self.times = board, requests, times
        self.completed = 0
        self.cancelled = 0
        self.tokens = 0

    def emit(self, seqs: list[Sequence]) -> None:
        """One round trip per step: each sequence's new token, `done` for finished ones, then
        the acks of the finished requests."""
        replies: list[tuple[str, Fields, int]] = []
        finished: list[tuple[str, bytes]] = []
        for seq in seqs:
            tok = seq.new_token
            # None: this step ended the sequence at EOS or a stop token; not fresh: an
            # earlier run of the request streamed this token already
            if tok is not None and seq.fresh:
                self.tokens += 1
                token = wire.ReplyEvent(
                    kind="token",
                    index=len(seq.generated) - 1,
                    token_id=tok,
                    text=seq.new_text,
                    logprob=seq.new_logprob,
                    top_logprobs=seq.new_top,
                    attempt=seq.attempt,
                    entry=seq.entry_id.decode(),
                )
                replies.append(self._reply(seq.request_id, token))
                self.times.token(seq.request_id)
            if seq.finish:
                replies.append(self._reply(seq.request_id, _done(seq)))
                finished.append((seq.source, seq.entry_id))
                self.completed += 1
                self.times.finished(seq.request_id, seq.finish)
        self.requests.answer(replies, finished, self.board.maxlen)

    def retire(self, seqs: list[Sequence]) -> None:
        """Answer and ack cancelled sequences (their client may be gone; the stream expires)."""
        if seqs:
            self.cancelled += len(seqs)
            for s in seqs:
                self.times.finished(s.request_id, "cancelled")
            replies = [self._reply(s.request_id, _done(s)) for s in seqs]
            done = [(s.source, s.entry_id) for s in seqs]
            self.requests.answer(replies, done, self.board.maxlen)

    def refuse(
        self, rid: str, stream: str, eid: bytes, attempt: int, kind: str, message: str
    ) -> None:
        """Answer request entry `eid` of `stream` with an error event, and ack it."""
        event = wire.ReplyEvent(
            kind="error",
            error=wire.Failure(type=kind, message=message),
            attempt=attempt,
            entry=eid.decode(),
        )
        self.times.finished(rid, "error")
        self.requests.answer([self._reply(rid, event)], [(stream, eid)], self.board.maxlen)

    def _reply(self, request_id: str, event: wire.ReplyEvent) -> tuple[str, Fields, int]:
        key = self.board.keys.request_reply(request_id)
        return key, wire.encode(event), self.board.lifetimes.reply_s()


def _done(seq: Sequence) -> wire.ReplyEvent:
    n = len(seq.generated)  # tokens streamed: EOS and stop tokens are not among them
    return wire.ReplyEvent(
        kind="done",
        index=n,
        text=seq.completion,
        finish=seq.finish,
        prompt_tokens=len(seq.prompt_ids),
        attempt=seq.attempt,
        entry=seq.entry_id.decode(),
        prompt=seq.prompt_lp or None,
    )
