"""The one wire codec: versioned msgpack maps, used by every producer and consumer.

A stream entry's field `m` holds the msgpack map. The hot path (jobs, results) carries nothing
else: each stream holds one message type, and every extra field costs on both sides of the
bus. Small human-facing messages (requests, reply events) also carry `t` (the type) and their
scalar fields as plain text so that `XRANGE` is readable; decoding reads `m` only.

Messages are `msgspec` structs encoded as msgpack maps (field names as keys, a `v` version
field); decoding validates types, ranges and tensor sizes before any tensor is built. Tensors
travel as `{"dtype", "shape", "data"}` with little-endian raw bytes. Failures travel as
`{"type", "message", "retryable"}`. No pickle anywhere.

Every decoding problem raises `WireError`, whatever the input bytes are.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, TypeVar, cast

import msgspec
import numpy as np

from kvq.errors import WireError

VERSION = 1
REQUEST_VERSION = 4  # requests; v1 to v3 ones still decode
REPLY_VERSION = 4  # reply events; v1 to v3 ones still decode
JOB_VERSION = 2  # expert jobs: v2 asks for per-pair terms, v1 (row sums) still decodes
MAX_LOGIT_BIAS = 300  # entries of a `logit_bias` (OpenAI's limit)
MAX_GRAMMAR = 1 << 20  # bytes of a compiled grammar
MAX_STOPS = 4
MAX_TOP_LOGPROBS = 5
MAX_DRAFT_TOKENS = 64  # a request's `draft_max`, as KVQ_DRAFT_TOKENS
DType = Literal["float32", "float16", "int32", "int64", "uint8"]
_NP: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
}
_NAME_OF = {dt: name for name, dt in _NP.items()}  # native little-endian dtypes only
# q8: int8 activations; f32cpu: float32 on the CPU, batch-invariant (`kvq.device.dtype_name`)
ComputeDType = Literal["float32", "float16", "bfloat16", "q8", "f32cpu"]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=1 << 24)]  # one dimension of a tensor on the wire
Bias = Annotated[float, msgspec.Meta(ge=-100, le=100)]
MAX_ELEMENTS = 1 << 32  # its dimensions multiplied (zeros left out): numpy can make it
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
MAX_STAGE_SEQS = 4096  # sequences one stage job carries at most
# a stage holder refused a job whole: some sequences must be replayed (`Result.lost`)
STATE_LOST = "StateLost"


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    v: Literal[1] = 1  # VERSION


class Failure(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A failure as it travels: what went wrong and whether retrying may help."""

    type: str
    message: str
    retryable: bool = False


class Tensor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tensor on the wire; sizes are checked when it is decoded or built."""

    dtype: DType
    shape: Annotated[list[Dim], msgspec.Meta(max_length=4)]
    data: bytes

    def __post_init__(self) -> None:
        if math.prod(d for d in self.shape if d) > MAX_ELEMENTS:  # [2^62, 0] holds no bytes
            raise ValueError(f"shape {self.shape} is larger than any tensor kvq sends")
        want = math.prod(self.shape) * _NP[self.dtype].itemsize
        if want != len(self.data):
            raise ValueError(
                f"tensor bytes {len(self.data)} != {want} for dtype {self.dtype} shape {self.shape}"
            )

    def array(self) -> np.ndarray:
        """A read-only numpy view of the bytes, [*shape]."""
        return np.frombuffer(self.data, dtype=_NP[self.dtype]).reshape(self.shape)

    @classmethod
    def of(cls, arr: np.ndarray) -> Tensor:
        name = _NAME_OF.get(arr.dtype)
        if name is None:  # e.g. big-endian or an unsupported dtype
            if arr.dtype.name not in _NP:
                raise WireError(f"cannot send dtype {arr.dtype.name}; allowed: {sorted(_NP)}")
            name = arr.dtype.name
            arr = arr.astype(_NP[name])
        return cls(name, list(arr.shape), arr.tobytes())  # type: ignore[arg-type]  # C order


class Job(_Msg, frozen=True, kw_only=True):
    """Token-level expert job: rows of one MoE layer routed to experts of one slice.

    v2 (`JOB_VERSION`): the result holds one row per (row, expert) pair inside the slice, in
    row-major (row, choice) order, each that pair's term `w * expert(x)`; the coordinator adds
    a token's terms in ascending expert id (`kvq.model.moe_sum`, X17). v1: one row per job row,
    the sum of its terms (what a worker still answers to a coordinator that predates v2)."""

    v: Literal[1, 2] = 2  # type: ignore[assignment]  # JOB_VERSION
    job_id: Name
    model: Name
    layer: NonNeg
    slice: Name
    expert_start: NonNeg
    expert_end: NonNeg
    coord: Name
    reply_to: Name
    deadline_ms: NonNeg
    x: Tensor  # [T, H] activations after the FFN norm
    ids: Tensor  # [T, k] global expert ids
    weights: Tensor  # [T, k] gate weights
    # the compute path the coordinator checks the result against (`kvq.coordinator.check`):
    # a result in another is refused; None = any (a coordinator that predates it)
    want_dtype: ComputeDType | None = None

    def __post_init__(self) -> None:
        xs, ids, ws = self.x.shape, self.ids.shape, self.weights.shape
        if len(xs) != 2 or len(ids) != 2 or ids != ws or ids[0] != xs[0]:
            raise ValueError(
                f"shapes x{xs} ids{ids} weights{ws} do not agree (want [T,H], [T,k], [T,k])"
            )
        if self.expert_end <= self.expert_start:
            raise ValueError(f"empty expert range [{self.expert_start}, {self.expert_end})")


class Result(_Msg, frozen=True, omit_defaults=True):
    """A worker's answer: an expert job's gate-weighted terms (v2 job: one row per pair
    inside the slice; v1 job: their sum per row), or a stage job's rows.

    Fields at their default are left out of the map, so a float32 worker's results still
    decode on a coordinator that predates `dtype` (which refuses unknown fields)."""

    job_id: Name
    worker: Name
    compute_ms: float = 0.0
    # [P, H] (v2 expert job), [T, H] (v1) or [N, H] (stage job): float32 on the wire
    # whatever the compute dtype
    y: Tensor | None = None
    error: Failure | None = None
    dtype: ComputeDType = "float32"  # what the worker computed in: the check's tolerance
    # a stage job's sequences whose state the holder does not have (`StageJob`): replay them
    lost: Annotated[list[Name], msgspec.Meta(max_length=MAX_STAGE_SEQS)] = []
    # a stage answer: what fixes its bits (`kvq.device.numerics`; "" none): two answers with
    # one label are compared bit for bit
    numerics: Annotated[str, msgspec.Meta(max_length=256)] = ""


class StageSeq(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One sequence's rows of a stage job: `rows` rows from position `start` on."""

    key: Name  # the sequence, as the coordinator names it to its stage holders
    start: NonNeg  # 0: a new or replayed sequence (any state held for `key` is dropped)
    rows: Annotated[int, msgspec.Meta(ge=1)]


class StageJob(_Msg, frozen=True):
    """A stage job (X12): the rows of the sequences on one chain entering a layer span, which
    the holder runs whole (attention against each sequence's own state, the span's experts)
    and answers with the rows leaving it (`Result.y`, [N, H]).

    A holder keeps each sequence's state between jobs (its KV cache, latent or recurrent
    state); a sequence whose `start` is not where its state ends is answered `StateLost`
    (retryable), and the coordinator replays its tokens from position 0. `then` names the
    spans that follow `slice` on the same holder: it runs them all and answers the rows
    leaving the last."""

    job_id: Name
    model: Name
    slice: Name  # the span's slice id
    coord: Name
    reply_to: Name
    deadline_ms: NonNeg
    seqs: Annotated[list[StageSeq], msgspec.Meta(min_length=1, max_length=MAX_STAGE_SEQS)]
    x: Tensor  # [N, H] the rows entering the span, the sequences' in `seqs` order
    drop: Annotated[list[Name], msgspec.Meta(max_length=MAX_STAGE_SEQS)] = []  # finished
    want_dtype: ComputeDType | None = None
    # the spans after `slice` the same holder runs next, in order, before it answers: one
    # round trip for consecutive spans held in one place
    then: Annotated[list[Name], msgspec.Meta(max_length=256)] = []
    # a referee's replay (one sequence): its rows run in these consecutive chunks, each
    # against the state the chunks before it left, as the holders it decides between ran them
    chunks: Annotated[
        list[Annotated[int, msgspec.Meta(ge=1)]], msgspec.Meta(max_length=1 << 16)
    ] = []

    def __post_init__(self) -> None:
        xs, n = self.x.shape, sum(s.rows for s in self.seqs)
        if len(xs) != 2 or xs[0] != n:
            raise ValueError(f"x{xs} does not hold the {n} rows its sequences name (want [N,H])")
        if len({s.key for s in self.seqs}) != len(self.seqs):
            raise ValueError("a sequence is named twice in one stage job")
        if self.chunks and (len(self.seqs) != 1 or sum(self.chunks) != n):
            raise ValueError(f"chunks {sum(self.chunks)} rows in all: want one sequence's {n}")


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a request's tokens are picked (defaults: greedy, no stops, no penalties)."""

    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] = 0.0  # 0 = greedy
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: NonNeg = 0  # 0 = no limit
    seed: int | None = None  # None: a fresh seed per request
    stop: Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1, max_length=256)]],
        msgspec.Meta(max_length=MAX_STOPS),
    ] = []
    stop_token_ids: Annotated[list[NonNeg], msgspec.Meta(max_length=64)] = []
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] = 0.0
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # top-n
    # v3: added to the logits before the grammar mask and sampling (OpenAI's `logit_bias`)
    logit_bias: Annotated[dict[NonNeg, Bias], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = {}
    # v3: an llguidance grammar (`kvq.text.grammar`): only tokens it allows are sampled
    grammar: Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR)] | None = None
    # v3: log-probabilities of the prompt's tokens (and this many alternatives each)
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # v4: the longest n-gram draft this request verifies per pass (X13; llama-server's
    # `speculative.n_max`): 0 = no drafts, None = the coordinator's `KVQ_DRAFT_TOKENS`
    draft_max: Annotated[int, msgspec.Meta(ge=0, le=MAX_DRAFT_TOKENS)] | None = None

    @property
    def greedy(self) -> bool:
        """Argmax of the raw logits: no temperature, penalty, stop string or logprob work."""
        return self.temperature == 0 and not self.presence_penalty and not self.frequency_penalty


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One message of a chat; rendered into a prompt by the model's chat template."""

    role: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    content: str
    # v3: an assistant's tool calls as JSON text (OpenAI's list, arguments as objects), and
    # the call a `tool` message answers
    tool_calls: str | None = None
    tool_call_id: str | None = None
    name: str | None = None


class Request(_Msg, frozen=True, kw_only=True):
    """A client's generation request. v1 (no sampling, no messages) still decodes: greedy."""

    v: Literal[1, 2, 3, 4] = 4  # type: ignore[assignment]  # REQUEST_VERSION
    request_id: Name
    model: Name
    prompt: str | None = None
    prompt_ids: list[NonNeg] | None = None
    messages: list[ChatMessage] | None = None  # v2: a chat, rendered by the coordinator
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    sampling: SamplingParams = SamplingParams()  # v2
    tools: str | None = None  # v3: OpenAI's `tools` as JSON text, handed to the chat template


class TokenLogprob(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A candidate token and its log-probability under the model (log_softmax of the logits)."""

    token_id: int
    text: str
    logprob: float


class PromptToken(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A prompt token with its log-probability given the tokens before it (None for the
    first) and the best alternatives there."""

    token_id: int
    text: str
    logprob: float | None
    top: list[TokenLogprob] = []


class ReplyEvent(_Msg, frozen=True, kw_only=True):
    """One event on a request's reply stream: a token, the end, or an error.

    A token event's `text` is the new text it makes final, which may be empty (held back while
    it could be the start of a stop string or of a multi-byte character) or cover several
    tokens; `done.text` is the whole completion, stop string excluded.

    `attempt` and `entry` (v3) let a reader follow one run of one request: a coordinator that
    restarts or takes a request over writes with a higher attempt and never re-sends a token
    index already written; a second request reusing the id is answered with its own `entry`."""

    v: Literal[1, 2, 3, 4] = 4  # type: ignore[assignment]  # REPLY_VERSION
    kind: Literal["token", "done", "error"]
    index: NonNeg = 0
    token_id: int | None = None
    text: str = ""
    finish: str | None = None
    error: Failure | None = None
    logprob: TokenLogprob | None = None  # v2: `token_id`'s own, when logprobs were asked
    top_logprobs: list[TokenLogprob] | None = None  # v2: the best alternatives
    prompt_tokens: NonNeg = 0  # v2, on `done`: the prompt's length in tokens
    attempt: NonNeg = 0  # v3: which run of the request wrote it (1 = first; 0 = unknown)
    entry: str = ""  # v3: the request entry it answers ("" = unknown; see kvq.client)
    prompt: list[PromptToken] | None = None  # v4, on `done`: the prompt's logprobs, if asked


class Cancel(_Msg, frozen=True):
    """A client gave up on a request (disconnected, interrupted): free its slot."""

    request_id: Name


M = TypeVar("M", bound=_Msg)
_NAMES: dict[type[_Msg], str] = {
    Job: "job",
    StageJob: "stage",
    Result: "result",
    Request: "request",
    ReplyEvent: "reply",
    Cancel: "cancel",
}
_READABLE = {
    "request": ("request_id", "model", "max_tokens"),
    "reply": ("kind", "index", "text"),
    "cancel": ("request_id",),
    "stage": ("slice",),
}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {cls: msgspec.msgpack.Decoder(cls) for cls in _NAMES}


def is_stage_job(fields: Any) -> bool:
    """Whether an inbox entry says it is a stage job (its readable `t` is "stage"); expert
    jobs carry no `t`."""
    try:
        t = fields.get(b"t", fields.get("t"))
    except Exception:  # noqa: BLE001 - not a field map: not a stage job
        return False
    return t in (b"stage", "stage")


def pack(msg: _Msg) -> bytes:
    return _ENCODER.encode(msg)


def encode(msg: _Msg) -> dict[str, bytes | str]:
    """Message → stream entry fields."""
    name = _NAMES[type(msg)]
    fields: dict[str, bytes | str] = {"m": _ENCODER.encode(msg)}
    readable = _READABLE.get(name)
    if readable:  # small human-facing messages also carry a readable copy for redis-cli
        fields["t"] = name
        for attr in readable:
            fields[attr] = str(getattr(msg, attr))
    return fields


def decode(fields: Any, expect: type[M]) -> M:
    """Stream entry fields → validated message of type `expect`, or WireError."""
    try:
        raw = fields.get(b"m", fields.get("m"))
    except Exception as exc:  # noqa: BLE001 - any malformed container is a wire error
        raise WireError(f"entry is not a field map: {exc}") from None
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise WireError("entry has no msgpack field 'm'")
    return unpack(bytes(raw), expect)


def unpack(raw: bytes, expect: type[M]) -> M:
    """msgpack bytes → validated message, or WireError (never anything else)."""
    try:
        return cast(M, _DECODERS[expect].decode(raw))
    except msgspec.ValidationError as exc:
        raise WireError(f"invalid {_NAMES[expect]}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - garbage bytes raise several types
        raise WireError(f"undecodable {_NAMES[expect]}: {type(exc).__name__}: {exc}") from None


def failure(exc: BaseException, retryable: bool = False) -> Failure:
    return Failure(type=type(exc).__name__, message=str(exc), retryable=retryable)


_LOOSE = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])  # keys only: values stay bytes


def request_id_of(fields: Any) -> str | None:
    """The `request_id` of a request entry that does not decode as a `Request` (wrong
    version, a bad field, a prompt of invalid UTF-8), so that its sender can still be told:
    read from the msgpack map if it is one (its other values are not decoded), else from the
    readable copy. None if neither holds a usable id."""
    for find in (_id_in_map, _readable_id):
        try:
            rid = find(fields)
        except Exception:  # noqa: BLE001 - whatever the entry holds, this place has no id
            continue
        if isinstance(rid, str) and 0 < len(rid) <= 512 and rid.isprintable():
            return rid
    return None


def _id_in_map(fields: Any) -> Any:
    raw = fields.get(b"m", fields.get("m"))
    body = _LOOSE.decode(raw) if isinstance(raw, bytes) else {}
    rid = body.get("request_id")
    return msgspec.msgpack.decode(rid, type=str) if rid is not None else None


def _readable_id(fields: Any) -> Any:
    rid = fields.get(b"request_id", fields.get("request_id"))
    return rid.decode() if isinstance(rid, bytes) else rid
