"""The typed parts of `kvq.config.Settings` that each component takes (STYLE habit 4).

The entry point builds one `Settings` from `KVQ_*` and carves it (`settings.bus`,
`settings.routing`, ...); a component's constructor names the one part it depends on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BusSettings:
    """How to reach Redis and shape its streams."""

    redis_url: str
    prefix: str
    stream_maxlen: int
    block_ms: int
    reconnect_max_s: float
    socket_timeout_s: float
    tls_ca_file: str = ""  # KVQ_TLS_CA_FILE: CA bundle that signs the server's certificate
    tls_cert_file: str = ""  # KVQ_TLS_CERT_FILE + KVQ_TLS_KEY_FILE: client certificate (mTLS)
    tls_key_file: str = ""
    tls_insecure: bool = False  # KVQ_TLS_INSECURE: no certificate check (logged as a warning)
    mode: str = "standalone"  # KVQ_REDIS_MODE resolved: standalone, cluster or sentinel


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    """The coordinator's swarm policy (K1-K4, H3)."""

    saturation_threshold: int
    worker_grace_ms: float
    ewma_alpha: float
    w_latency: float
    w_load: float
    w_score: float
    w_hops: float
    w_tokens: float
    refresh_ms: int
    local_experts: bool  # KVQ_COORDINATOR_EXPERTS=all
    reprobe_ms: float = 5_000.0  # KVQ_REPROBE_MS
    half_life_ms: float = 60_000.0  # KVQ_ESTIMATE_HALF_LIFE_MS
    policy: str = "capacity"  # KVQ_DISPATCH_POLICY: capacity | copies


@dataclass(frozen=True, slots=True)
class DispatchSettings:
    """Remote expert jobs: deadline before the local fallback, verification (trust), and how
    many micro-batches an engine step is cut into while remote jobs are in use."""

    job_deadline_ms: int
    verify_remote: str = "sampled"  # sampled | all | off (KVQ_VERIFY_REMOTE)
    trust_full_checks: int = 50
    trust_decay: float = 0.95
    trust_p_min: float = 0.02
    trust_quarantine_s: float = 600.0
    trust_ban_after: int = 3
    microbatches: int = 1
    trust_step_floor: float = 0.3  # KVQ_TRUST_STEP_FLOOR
    replica_wait_s: float = 30.0  # KVQ_REPLICA_WAIT_S: a backbone-only coordinator's wait


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    """The coordinator's serving loop."""

    n_slots: int
    saturation_threshold: int
    slot_poll_s: float
    claim_idle_ms: int
    model_wait_s: float
    max_tokens_limit: int
    block_ms: int
    reconnect_max_s: float
    compute_dtype: str = "auto"  # KVQ_COMPUTE_DTYPE (kvq.device.compute_dtype)
    max_attempts: int = 3  # KVQ_MAX_ATTEMPTS


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """A worker's loop: demand polling, wind-down, device, downloads."""

    volunteer_poll_s: float
    idle_shutdown_s: float
    device: str
    download_timeout_s: float
    block_ms: int
    reconnect_max_s: float
    compute_dtype: str = "auto"  # KVQ_COMPUTE_DTYPE (kvq.device.compute_dtype)
    load_retry_max_s: float = 60.0  # cap of the back-off after a failed slice load
    idle_release_s: float = 90.0  # KVQ_IDLE_RELEASE_S: wind-down of a surplus slice
    market: str = "auto"  # KVQ_WORKER_MARKET: auto | direct | monitor (kvq.bus.market)
    market_wait_s: float = 5.0  # KVQ_MARKET_WAIT_S: longest wait for the monitor's answer
    memory_gib: float = 0.0  # KVQ_WORKER_MEMORY_GIB: slice bytes it may hold (0 = auto)
    memory_reserve_gib: float = 1.0  # KVQ_WORKER_MEMORY_RESERVE_GIB: what auto leaves free
    max_slices: int = 0  # KVQ_WORKER_MAX_SLICES: 0 = as many as the budget fits


@dataclass(frozen=True, slots=True)
class MonitorSettings:
    """The control plane: slicing, replica targets, polling, HTTP."""

    slice_layers: int
    slice_experts: int
    base_replicas: int
    boost_replicas: int
    saturation_threshold: int
    poll_s: float
    reconnect_max_s: float
    http_host: str
    http_port: int
    saturation_enter_s: float = 0.0  # K6 hysteresis (kvq.monitor.hysteresis)
    saturation_leave_s: float = 0.0
    lease_s: float = 5.0  # KVQ_MONITOR_LEASE_S: one active monitor, standbys take over
    request_shards: int = 1  # KVQ_REQUEST_SHARDS: request streams per model it registers
    backbone_replicas: int = 2  # KVQ_BACKBONE_REPLICAS: the base without a computing coordinator


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """The OpenAI-compatible gateway (`kvq api`)."""

    host: str
    port: int
    keys: tuple[str, ...]  # bearer tokens; empty: no auth
    key_rpm: int  # requests per minute per key; 0: no limit
    max_queue: int  # a model's waiting requests at which new ones get 429
    timeout_s: float  # longest wait for a request's next event
    retry_after_s: int
    max_tokens_default: int
    cors_origins: tuple[str, ...] = ()  # browser origins allowed; empty: no CORS
