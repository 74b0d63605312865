"""The typed parts of `kvq.config.Settings` that each component takes (STYLE habit 4).

The entry point builds one `Settings` from `KVQ_*` and carves it (`settings.bus`,
`settings.routing`, ...); a component's constructor names the one part it depends on.

A part holds no defaults: each field is filled from the `Settings` field of the same name, or
of the name its `From(...)` mark gives, or is computed by `Settings` (`COMPUTED`), so every
default is written once, in `kvq.config.Settings` (`tests/unit/test_settings_parts.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated


@dataclass(frozen=True, slots=True)
class From:
    """`Annotated` mark of a part's field filled from `Settings.<setting>` (its name differs
    from the part's); `COMPUTED` (no name): `Settings` computes it when it carves the part."""

    setting: str


COMPUTED = From("")


@dataclass(frozen=True, slots=True)
class BusSettings:
    """How to reach Redis and shape its streams."""

    redis_url: str
    prefix: str
    stream_maxlen: int
    block_ms: int
    reconnect_max_s: float
    socket_timeout_s: float
    tls_ca_file: str  # KVQ_TLS_CA_FILE: CA bundle that signs the server's certificate
    tls_cert_file: str  # KVQ_TLS_CERT_FILE + KVQ_TLS_KEY_FILE: client certificate (mTLS)
    tls_key_file: str
    tls_insecure: bool  # KVQ_TLS_INSECURE: no certificate check (logged as a warning)
    mode: Annotated[str, COMPUTED]  # KVQ_REDIS_MODE resolved: standalone, cluster or sentinel


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    """The coordinator's swarm policy (K1-K4, H3)."""

    saturation_threshold: int
    worker_grace_ms: float
    ewma_alpha: Annotated[float, From("swarm_ewma_alpha")]
    w_latency: Annotated[float, From("cost_w_latency")]
    w_load: Annotated[float, From("cost_w_load")]
    w_score: Annotated[float, From("cost_w_score")]
    w_hops: Annotated[float, From("cost_w_hops")]
    w_tokens: Annotated[float, From("cost_w_tokens")]
    refresh_ms: Annotated[int, From("dispatch_refresh_ms")]
    local_experts: Annotated[bool, COMPUTED]  # KVQ_COORDINATOR_EXPERTS=all
    reprobe_ms: float  # KVQ_REPROBE_MS
    half_life_ms: Annotated[float, From("estimate_half_life_ms")]  # KVQ_ESTIMATE_HALF_LIFE_MS
    policy: Annotated[str, From("dispatch_policy")]  # KVQ_DISPATCH_POLICY: capacity | copies


@dataclass(frozen=True, slots=True)
class DispatchSettings:
    """Remote expert jobs: deadline before the local fallback, verification (trust), and how
    many micro-batches an engine step is cut into while remote jobs are in use."""

    job_deadline_ms: int
    verify_remote: str  # sampled | all | off (KVQ_VERIFY_REMOTE)
    gpu_workers: str  # KVQ_GPU_WORKERS: ids admitted to a GPU dtype's tolerance, or *
    trust_full_checks: int
    trust_decay: float
    trust_p_min: float
    trust_quarantine_s: float
    trust_ban_after: int
    microbatches: int
    trust_step_floor: float  # KVQ_TRUST_STEP_FLOOR
    replica_wait_s: float  # KVQ_REPLICA_WAIT_S: a backbone-only coordinator's wait
    stage_deadline_ms: int  # KVQ_STAGE_DEADLINE_MS: a stage job's answer, before replay


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    """The coordinator's serving loop."""

    n_slots: int
    prefill_chunk: int  # KVQ_PREFILL_CHUNK: chunked prefill's token budget per step
    speculative: str  # KVQ_SPECULATIVE: off | ngram (kvq.coordinator.drafts)
    draft_tokens: int  # KVQ_DRAFT_TOKENS: the longest draft verified in one pass
    saturation_threshold: int
    slot_poll_s: float
    claim_idle_ms: int
    model_wait_s: float
    max_tokens_limit: int
    block_ms: int
    reconnect_max_s: float
    compute_dtype: str  # KVQ_COMPUTE_DTYPE (kvq.device.compute_dtype)
    max_attempts: int  # KVQ_MAX_ATTEMPTS


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """A worker's loop: demand polling, wind-down, device, downloads."""

    volunteer_poll_s: float
    idle_shutdown_s: float
    device: str
    download_timeout_s: float
    block_ms: int
    reconnect_max_s: float
    compute_dtype: str  # KVQ_COMPUTE_DTYPE (kvq.device.compute_dtype)
    load_retry_max_s: float  # cap of the back-off after a failed slice load
    idle_release_s: float  # KVQ_IDLE_RELEASE_S: wind-down of a surplus slice
    market: Annotated[
        str, From("worker_market")
    ]  # KVQ_WORKER_MARKET: auto | direct | monitor (kvq.bus.market)
    market_wait_s: float  # KVQ_MARKET_WAIT_S: longest wait for the monitor's answer
    memory_gib: Annotated[
        float, From("worker_memory_gib")
    ]  # KVQ_WORKER_MEMORY_GIB: slice bytes it may hold (0 = auto)
    memory_reserve_gib: Annotated[
        float, From("worker_memory_reserve_gib")
    ]  # KVQ_WORKER_MEMORY_RESERVE_GIB: what auto leaves free
    max_slices: Annotated[
        int, From("worker_max_slices")
    ]  # KVQ_WORKER_MAX_SLICES: 0 = as many as the budget fits
    stage_max_seqs: int  # KVQ_STAGE_MAX_SEQS: sequence states a stage slice keeps (X12)


@dataclass(frozen=True, slots=True)
class MonitorSettings:
    """The control plane: slicing, replica targets, polling, HTTP."""

    slice_layers: int
    slice_experts: int
    grain: str  # KVQ_GRAIN: expert | stage, for the models this monitor registers (X12)
    stage_layers: int  # KVQ_STAGE_LAYERS: blocks per stage slice at stage grain
    base_replicas: int
    boost_replicas: int
    saturation_threshold: int
    poll_s: Annotated[float, From("monitor_poll_s")]
    reconnect_max_s: float
    http_host: str
    http_port: int
    saturation_enter_s: float  # K6 hysteresis (kvq.monitor.hysteresis)
    saturation_leave_s: float
    lease_s: Annotated[
        float, From("monitor_lease_s")
    ]  # KVQ_MONITOR_LEASE_S: one active monitor, standbys take over
    request_shards: int  # KVQ_REQUEST_SHARDS: request streams per model it registers
    backbone_replicas: int  # KVQ_BACKBONE_REPLICAS: the base without a computing coordinator
    worker_quota_mib: int  # KVQ_WORKER_QUOTA_MIB: a worker user's keys (kvq.monitor.quota)


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """The OpenAI-compatible gateway (`kvq api`)."""

    host: Annotated[str, From("api_host")]
    port: Annotated[int, From("api_port")]
    keys: Annotated[tuple[str, ...], COMPUTED]  # bearer tokens; empty: no auth
    key_rpm: Annotated[int, From("api_key_rpm")]  # requests per minute per key; 0: no limit
    max_queue: Annotated[
        int, From("api_max_queue")
    ]  # a model's waiting requests at which new ones get 429
    timeout_s: Annotated[float, From("api_timeout_s")]  # longest wait for a request's next event
    retry_after_s: Annotated[int, From("api_retry_after_s")]
    max_tokens_default: Annotated[int, From("api_max_tokens_default")]
    cors_origins: Annotated[tuple[str, ...], COMPUTED]  # browser origins allowed; empty: no CORS
