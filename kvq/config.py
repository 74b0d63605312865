"""kvq's settings: one object, read from `KVQ_*` environment variables, validated at start.

Build it once at the entry point with `load_settings()` and pass it down; nothing below the
CLI reads the environment. Every field's env name is `KVQ_` + the field name in upper case
(`n_slots` → `KVQ_N_SLOTS`). `docs/settings.md` lists them all.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal, TypeVar, get_args, get_type_hints

from pydantic import Field, ValidationError
from pydantic_settings import SettingsConfigDict

from kvq.bus.records import Lifetimes  # the bus takes its settings from kvq.settings_parts
from kvq.errors import ConfigError
from kvq.settings_checks import RedisMode, SettingsChecks, mode_of_url
from kvq.settings_parts import (
    COMPUTED,
    ApiSettings,
    BusSettings,
    CoordinatorSettings,
    DispatchSettings,
    From,
    MonitorSettings,
    RoutingSettings,
    WorkerSettings,
)

P = TypeVar("P")  # a part of the settings (kvq.settings_parts)

__all__ = [
    "NUMA_POLICIES",
    "ApiSettings",
    "BusSettings",
    "CoordinatorSettings",
    "DispatchSettings",
    "MonitorSettings",
    "NumaPolicy",
    "RoutingSettings",
    "Settings",
    "WorkerSettings",
    "child_env",
    "describe",
    "env_name",
    "load_settings",
]
NumaPolicy = Literal["preferred", "bind", "off"]
NUMA_POLICIES: tuple[str, ...] = get_args(NumaPolicy)


class Settings(SettingsChecks):
    """Every knob of every kvq process (units in the names)."""

    model_config = SettingsConfigDict(
        env_prefix="KVQ_", extra="forbid", frozen=True, allow_inf_nan=False
    )

    # -- Redis / bus --------------------------------------------------------------------
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis server to use")
    redis_mode: RedisMode = Field(
        "auto",
        description="standalone, cluster (Redis/Valkey Cluster) or sentinel; auto: as "
        "KVQ_REDIS_URL's scheme says (redis+cluster://, redis+sentinel://host:port/master)",
    )
    rq_url: str = Field(
        "",
        description="standalone Redis for RQ's coarse jobs ('' = KVQ_REDIS_URL); RQ is not "
        "cluster-safe",
    )
    prefix: str = Field("kvq", description="first part of every key")
    stream_maxlen: int = Field(10_000, ge=100, description="approximate cap of every stream")
    block_ms: int = Field(1000, ge=1, le=60_000, description="blocking read timeout")
    claim_idle_ms: int = Field(
        5000, ge=1, description="a dead coordinator's requests idle this long are taken over"
    )
    reconnect_max_s: float = Field(10.0, gt=0, description="longest backoff between reconnects")
    socket_timeout_s: float = Field(5.0, gt=0, description="Redis socket timeout")
    tls_ca_file: str = Field(
        "", description="CA bundle (PEM) that signs the Redis server's certificate (rediss://)"
    )
    tls_cert_file: str = Field("", description="client certificate (PEM) for mutual TLS")
    tls_key_file: str = Field("", description="private key (PEM) of KVQ_TLS_CERT_FILE")
    tls_insecure: bool = Field(
        False, description="do not verify the server's certificate (logs a warning; tests only)"
    )

    # -- coordinator --------------------------------------------------------------------
    n_slots: int = Field(4, ge=1, le=1024, description="sequences generated together")
    prefill_chunk: int = Field(
        512,
        ge=0,
        le=1_048_576,
        description="prompt tokens one engine step reads at most, over every sequence still "
        "reading its prompt (chunked prefill: the other sequences decode between the chunks "
        "of a long prompt); 0 = each prompt whole in one step",
    )
    speculative: Literal["off", "ngram"] = Field(
        "off",
        description="speculative decoding (X13): ngram drafts each greedy sequence's next tokens "
        "from its own prompt and output and verifies them in the step's one forward pass",
    )
    draft_tokens: int = Field(
        4,
        ge=1,
        le=64,
        description="the longest draft a sequence verifies in one pass (a request "
        "may ask for fewer: speculative.n_max)",
    )
    saturation_threshold: int = Field(2, ge=1, description="busy slots at which it is loaded")
    job_deadline_ms: int = Field(
        2000, ge=1, description="remote expert job deadline before local fallback"
    )
    stage_deadline_ms: int = Field(
        30000,
        ge=1,
        le=3_600_000,
        description="how long a stage job (X12) may go unanswered while its holder is alive "
        "before its sequences move to another holder of the span and are replayed there (a "
        "holder whose heartbeat expires is left at once)",
    )
    replica_wait_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="a coordinator without a slice's experts (a backbone file) waits this long "
        "for a live worker serving it (none yet, or every one failed the job), then the "
        "requests of that step end with a NoReplica error",
    )
    slot_poll_s: float = Field(
        0.5, gt=0, le=60, description="how often the coordinator samples its own busy slots"
    )
    coordinator_experts: Literal["all", "none"] = Field(
        "all", description="all: the coordinator computes any slice itself; none: workers only"
    )
    worker_grace_ms: float = Field(
        10_000.0, ge=0, description="an unproven worker's window for its one first try (K4)"
    )
    reprobe_ms: float = Field(
        5_000.0,
        gt=0,
        description="under load, a live worker the route does not use gets one "
        "job this often, so a worker priced out by slow samples can win work back",
    )
    estimate_half_life_ms: float = Field(
        60_000.0,
        gt=0,
        description="a worker's latency estimate fades toward the 50 ms prior "
        "with this half-life while it sends no samples",
    )
    dispatch_policy: Literal["capacity", "copies"] = Field(
        "capacity",
        description="under load, capacity: split each MoE layer's slices over the coordinator "
        "and eligible workers so the layer finishes soonest; copies: the cheapest whole copy",
    )
    cost_w_latency: float = Field(1.0, ge=0, le=1000, description="H3 weight of node latency")
    cost_w_load: float = Field(1.0, ge=0, le=1000, description="H3 weight of node load")
    cost_w_score: float = Field(1.0, ge=0, le=1000, description="H3 weight of 100/score")
    cost_w_hops: float = Field(1.0, ge=0, le=1000, description="H3 weight of hops")
    cost_w_tokens: float = Field(1.0, ge=0, le=1000, description="H3 weight of request tokens")
    swarm_ewma_alpha: float = Field(
        0.3, gt=0, le=1, description="weight of a new latency/load sample in the EWMAs"
    )
    dispatch_refresh_ms: int = Field(500, ge=10, description="how often coverage is reread")
    model_wait_s: float = Field(
        300.0, gt=0, description="how long a coordinator waits for its model's registration"
    )
    verify_remote: Literal["sampled", "all", "off"] = Field(
        "sampled",
        description="remote results recomputed here before use: sampled by graded trust "
        "(KVQ_TRUST_*), all, or off (results used unchecked; NaN/inf are still refused)",
    )
    gpu_workers: str = Field(
        "",
        description="worker ids (comma-separated; * for any) the operator admits to compute in "
        "a GPU dtype (bfloat16, float16), checked by that dtype's looser tolerance; any other "
        "worker is held to the coordinator's own path (X3: no worker loosens its own check)",
    )
    trust_full_checks: int = Field(
        50, ge=0, le=100_000, description="a worker's first verified results, all checked"
    )
    trust_decay: float = Field(
        0.95,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="check probability factor per further verified result",
    )
    trust_p_min: float = Field(
        0.02,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="floor of the check probability: a trusted worker's share recomputed",
    )
    trust_quarantine_s: float = Field(
        600.0, ge=0, allow_inf_nan=False, description="a worker caught lying gets no work this long"
    )
    trust_ban_after: int = Field(
        3, ge=1, description="mismatches after which a worker id is banned for good"
    )
    trust_step_floor: float = Field(
        0.3,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="chance that at least one of a worker's jobs in each engine step is "
        "checked, however long its clean streak (trust that cannot be banked)",
    )
    microbatches: int = Field(
        1,
        ge=1,
        le=8,
        description="micro-batches per engine step while remote expert jobs are in use: one "
        "micro-batch's attention runs while another's remote experts are in flight",
    )
    request_ttl_s: int = Field(600, ge=1, description="lifetime of a request's reply stream")
    max_tokens_limit: int = Field(512, ge=1, description="largest max_tokens a request may ask")
    max_attempts: int = Field(
        3,
        ge=1,
        le=100,
        description="a request started this many times without finishing (its coordinators "
        "died or stopped mid-request) is dead-lettered with an error event, not started again",
    )

    # -- worker -------------------------------------------------------------------------
    heartbeat_ttl_s: float = Field(6.0, gt=0, description="a worker silent this long is dead")
    volunteer_poll_s: float = Field(0.5, gt=0, description="idle worker's demand poll period")
    idle_release_s: float = Field(
        90.0,
        ge=0,
        description="a worker with no job for this long gives back a slice covered beyond its "
        "target and volunteers again (wind-down; 0 = keep it)",
    )
    idle_shutdown_s: float = Field(
        0.0, ge=0, description="a worker holding no slice exits after this long (0 = never)"
    )
    device: str = Field("auto", description="torch device: auto, cpu, cuda, cuda:N")
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="expert compute dtype; auto = never below the stored precision (float32 "
        "for quantized experts)",
    )
    activations: Literal["float32", "int8"] = Field(
        "int8",
        description="activations of the CPU kernels on quantized weights: int8 (the default: "
        "quantized per block, integer dot products, as llama.cpp; faster, the same bits on "
        "every SIMD path) or float32 (exact to float32 rounding)",
    )
    batch_invariant: bool = Field(
        True,
        description="float32 matrix products on the CPU give each row the bits it gets alone, "
        "so a request's tokens do not depend on its batch (X17); false: plain products, faster "
        "prompts on float weights, batch-dependent bits",
    )
    download_timeout_s: float = Field(60.0, gt=0, description="HTTP slice download timeout")
    load_retry_max_s: float = Field(
        60.0, gt=0, description="longest wait before volunteering again after a failed slice load"
    )
    worker_market: Literal["auto", "direct", "monitor"] = Field(
        "auto",
        description="how a worker takes slices: direct (runs the market scripts), monitor "
        "(asks the monitor), auto (monitor unless connected as the default user)",
    )
    market_wait_s: float = Field(
        5.0, gt=0, le=600, description="longest wait of a worker for the monitor's market answer"
    )
    state_dir: str = Field(
        "", description="where a worker keeps its default id (empty = ~/.config/kvq)"
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="log lines on stderr: text, or one JSON object a line"
    )
    worker_memory_gib: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="memory a worker fills with slices, in GiB of published slice bytes; it "
        "volunteers while the next slice fits (0 = auto: free memory of its device at start, "
        "host RAM or CUDA, less KVQ_WORKER_MEMORY_RESERVE_GIB)",
    )
    worker_memory_reserve_gib: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="memory the auto worker budget leaves free (KVQ_WORKER_MEMORY_GIB=0)",
    )
    stage_max_seqs: int = Field(
        256,
        ge=1,
        le=65536,
        description="sequence states (KV caches) a worker keeps per stage slice; the least "
        "recently used goes first, and its coordinator replays it if it comes back",
    )
    worker_max_slices: int = Field(
        0,
        ge=0,
        le=4096,
        description="slices a worker holds at most, of one model or several (0 = as many "
        "as the memory budget fits; 1 = one slice at a time)",
    )

    # -- monitor ------------------------------------------------------------------------
    slice_experts: int = Field(4, ge=1, description="experts per slice (expert grain)")
    slice_layers: int = Field(1, ge=1, description="MoE layers per slice (expert grain)")
    grain: Literal["expert", "stage"] = Field(
        "expert",
        description="how the models this monitor registers are cut (X12): expert (slices of "
        "routed experts; attention stays with the coordinator: every MoE layer of a token is "
        "a round trip, for rack latency) or stage (layer spans served whole: a token crosses "
        "the network once per stage, for WAN latency); docs/routing.md",
    )
    stage_layers: int = Field(
        4, ge=1, le=4096, description="blocks per stage slice (KVQ_GRAIN=stage)"
    )
    base_replicas: int = Field(1, ge=0, description="worker replicas wanted per slice at rest")
    backbone_replicas: int = Field(
        2,
        ge=0,
        description="replicas per slice at rest while a live coordinator of the model holds "
        "no experts (a backbone file): the larger of this and KVQ_BASE_REPLICAS, so that a "
        "lost worker leaves a copy and replicas can check each other (quorum)",
    )
    request_shards: int = Field(
        1,
        ge=1,
        le=256,
        description="request streams per model the monitor registers, each with its own hash "
        "tag: a Redis Cluster spreads them over its masters (clients pick one by request id)",
    )
    boost_replicas: int = Field(1, ge=0, description="extra replicas while saturated")
    saturation_enter_s: float = Field(
        2.0, ge=0, description="busy must stay >= threshold this long before the boost starts"
    )
    saturation_leave_s: float = Field(
        30.0, ge=0, description="busy must stay < threshold this long before the boost ends"
    )
    monitor_poll_s: float = Field(1.0, gt=0, description="how often slot state is polled")
    monitor_lease_s: float = Field(
        5.0,
        gt=0,
        description="the active monitor's lease; a standby takes over this long after the "
        "active one stops renewing it (must exceed KVQ_MONITOR_POLL_S)",
    )
    worker_quota_mib: int = Field(
        256,
        ge=1,
        description="what one worker's ACL user may make Redis hold in its keys (beat, record, "
        "asks, results streams); the monitor disables a user over it (kvq.monitor.quota)",
    )
    slot_state_stale_s: float = Field(
        10.0, gt=0, description="slot state older than this is ignored"
    )
    http_host: str = Field("127.0.0.1", description="address the monitor's HTTP API binds to")
    http_port: int = Field(
        0, ge=0, le=65535, description="port of the monitor's HTTP API and /metrics (0 = off)"
    )
    http_volunteer: Literal["acl", "open", "off"] = Field(
        "acl",
        description="POST /api/expert-volunteer: acl = only with the worker's ACL "
        "password as bearer token (checked by AUTH); open = anyone (development); off = 403",
    )

    monitor_tokens: str = Field(
        "",
        description="operators who may act on the dashboard (cancel, dead letters, quarantine, "
        "release, drain): name=token pairs, comma-separated, each token sent as bearer; "
        "empty = a read-only dashboard (actions answer 403)",
    )

    monitor_history_s: float = Field(
        3600.0,
        ge=600.0,
        le=7 * 86400.0,
        description="how far back the dashboard's charts can look (the monitor's sampled "
        "metrics): every 5 s sample of the last 10 minutes, older ones thinned to 240 points",
    )

    # -- OpenAI-compatible gateway (kvq api, docs/api.md) --------------------------------
    api_host: str = Field("127.0.0.1", description="address `kvq api` binds to")
    api_port: int = Field(8000, ge=0, le=65535, description="port of `kvq api` (0 = any free)")
    api_keys: str = Field(
        "", description="comma-separated bearer tokens `kvq api` accepts (empty = no auth)"
    )
    api_key_rpm: int = Field(
        0, ge=0, description="requests per minute per API key, over all gateways (0 = no limit)"
    )
    api_max_queue: int = Field(
        64, ge=1, description="a model's queued requests at which `kvq api` answers 429"
    )
    api_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="longest time `kvq api` waits without progress of a request or its queue",
    )
    api_retry_after_s: int = Field(1, ge=1, le=3600, description="Retry-After of a 429 or 503")
    api_max_tokens_default: int = Field(
        16,
        ge=1,
        description="max_tokens of a completion that does not say (a chat: the room "
        "left in the context)",
    )
    api_cors_origins: str = Field(
        "",
        description="comma-separated origins browsers may call `kvq api` from (`*` = any; "
        "empty = no CORS headers)",
    )

    # -- bank (hot/cold experts, docs/bank.md) ------------------------------------------
    hot_gib: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="hot bank budget per node in GiB (empty = the stock placement's device bytes)",
    )
    dynamic: bool = Field(True, description="swap hot experts at run time (0 = static hot set)")
    dyn_steps: int = Field(2000, ge=1, description="engine steps between dynamic updates")
    dyn_max_swaps: int = Field(
        2, ge=1, le=4096, description="hot/cold swaps per layer per dynamic update, at most"
    )
    dyn_margin: float = Field(
        1.25,
        ge=1.0,
        le=1000.0,
        allow_inf_nan=False,
        description="swap only if incoming count > margin x outgoing count",
    )
    vram_reserve_gib: float = Field(
        2.0, ge=0, allow_inf_nan=False, description="device memory the hot bank leaves free"
    )
    numa_policy: NumaPolicy = Field(
        "preferred", description="host memory of the cold bank: preferred, bind or off"
    )

    @property
    def redis_mode_resolved(self) -> str:
        return mode_of_url(self.redis_url) if self.redis_mode == "auto" else self.redis_mode

    # -- the sub-settings each component takes (STYLE habit 4) ----------------------------
    def carve(self, part: type[P], **computed: Any) -> P:
        """The part `part` of these settings: each field from the setting of its name (or of
        the name its `From(...)` mark says), the `COMPUTED` ones given here."""
        hints = get_type_hints(part, include_extras=True)
        values = {}
        for f in dataclasses.fields(part):  # type: ignore[arg-type]
            mark = next(
                (m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, From)), None
            )
            if mark == COMPUTED:
                values[f.name] = computed.pop(f.name)
            else:
                values[f.name] = getattr(self, mark.setting if mark else f.name)
        if computed:
            raise TypeError(f"{part.__name__} has no computed field {sorted(computed)}")
        return part(**values)

    @property
    def bus(self) -> BusSettings:
        return self.carve(BusSettings, mode=self.redis_mode_resolved)

    @property
    def lifetimes(self) -> Lifetimes:
        return Lifetimes(self.heartbeat_ttl_s, self.slot_state_stale_s, self.request_ttl_s)

    @property
    def routing(self) -> RoutingSettings:
        return self.carve(RoutingSettings, local_experts=self.coordinator_experts == "all")

    @property
    def coarse_url(self) -> str:
        """Where RQ's coarse jobs live (`kvq.monitor.coarse`); "" when there is no standalone
        server for them (KVQ_RQ_URL unset on a cluster or Sentinel): they then run inline."""
        if self.rq_url:
            return self.rq_url
        return self.redis_url if self.redis_mode_resolved == "standalone" else ""

    @property
    def dispatch(self) -> DispatchSettings:
        return self.carve(DispatchSettings)

    @property
    def coordinator(self) -> CoordinatorSettings:
        return self.carve(CoordinatorSettings)

    @property
    def worker(self) -> WorkerSettings:
        return self.carve(WorkerSettings)

    @property
    def api(self) -> ApiSettings:
        def listed(text: str) -> tuple[str, ...]:
            return tuple(k.strip() for k in text.split(",") if k.strip())

        return self.carve(
            ApiSettings, keys=listed(self.api_keys), cors_origins=listed(self.api_cors_origins)
        )

    @property
    def monitor(self) -> MonitorSettings:
        return self.carve(MonitorSettings)


def env_name(field: str) -> str:
    return "KVQ_" + field.upper()


def load_settings(**overrides: Any) -> Settings:
    """Read the environment (and explicit overrides), or raise ConfigError naming the setting.

    A `KVQ_*` variable that names no setting is an error too: a typo must not pass silently.
    """
    known = {env_name(f) for f in Settings.model_fields}
    unknown = sorted(k for k in os.environ if k.startswith("KVQ_") and k not in known)
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)}; `kvq config show` lists the valid ones"
        )
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = err.get("loc") or ()
            name = env_name(str(loc[0])) if loc else "settings"
            got = redact(str(loc[0]), err.get("input")) if loc else err.get("input")
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            lines.append(f"{name}: {msg} (got {got!r})" if loc else f"{name}: {msg}")
        raise ConfigError("invalid settings:\n  " + "\n  ".join(lines)) from None


SECRET_SETTINGS = ("redis_url", "rq_url", "api_keys", "monitor_tokens")  # printed redacted


def redact(name: str, value: Any) -> Any:
    """`value` of setting `name` as it may be printed: no password, no API key."""
    if name in ("redis_url", "rq_url") and isinstance(value, str):
        from kvq.security.redact import redacted_url

        return redacted_url(value)
    if name in ("api_keys", "monitor_tokens") and value:
        return "***"
    return value


def describe(settings: Settings) -> list[dict[str, Any]]:
    """Each setting with its env name, value (secrets redacted), default and description (for
    `config show`)."""
    out = []
    for name, field in Settings.model_fields.items():
        out.append(
            {
                "name": name,
                "env": env_name(name),
                "value": redact(name, getattr(settings, name)),
                "default": field.default,
                "description": field.description or "",
            }
        )
    return out


def child_env(settings: Settings, **overrides: Any) -> dict[str, str]:
    """Environment for a child kvq process: this process's env plus every setting as KVQ_*,
    except those left at their defaults (the child reads the same default, and a default is
    not a choice the child's checks could find contradicting another setting)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")}
    values = settings.model_dump() | overrides
    for name, value in values.items():
        field = Settings.model_fields.get(name)
        chosen = name in settings.model_fields_set or name in overrides
        if field is not None and not chosen and value == field.default:
            continue
        if isinstance(value, bool):
            value = int(value)
        env[env_name(name)] = str(value)
    return env
