"""The cross-field and format checks of `kvq.config.Settings`, kept apart from its field list.

`Settings` inherits them; each names fields that `Settings` declares (hence
`check_fields=False`). A check that reads another field (`info.data`) relies on that field
being declared earlier in `Settings`.
"""

from __future__ import annotations

import os
import re
from typing import Literal
from urllib.parse import parse_qsl, urlparse

from pydantic import ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings

from kvq.errors import ConfigError
from kvq.keys import check_id

_BOOLISH = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
}
_REDIS_SCHEMES = (
    "redis",
    "rediss",
    "unix",
    "redis+cluster",
    "rediss+cluster",
    "redis+sentinel",
    "rediss+sentinel",
)
RedisMode = Literal["auto", "standalone", "cluster", "sentinel"]
_WHY_WITHIN_SLOTS = {
    "saturation_threshold": ", or the coordinator can never be saturated",
    "microbatches": ": a micro-batch holds at least one sequence",
}


def mode_of_url(url: str) -> str:
    """standalone, cluster or sentinel, as the URL's scheme says (`redis+cluster://...`)."""
    scheme = urlparse(url).scheme
    return scheme.split("+", 1)[1] if "+" in scheme else "standalone"


_NO_CERT_CHECK = {"none", "optional", "cert_none", "cert_optional"}


def tls_weakening(url: str) -> str:
    """The query options of `url` that weaken TLS verification (redis-py reads them from the
    URL: `ssl_cert_reqs=none|optional`, `ssl_check_hostname=false`), as `k=v` text, or ""."""
    found = []
    for key, value in parse_qsl(urlparse(url).query, keep_blank_values=True):
        v = value.strip().lower()
        if key == "ssl_cert_reqs" and v in _NO_CERT_CHECK:
            found.append(f"{key}={value}")
        elif key == "ssl_check_hostname" and v in _BOOLISH and not _BOOLISH[v]:
            found.append(f"{key}={value}")
    return ", ".join(found)


class SettingsChecks(BaseSettings):
    """Validators only: `kvq.config.Settings` declares the fields."""

    @field_validator("hot_gib", mode="before", check_fields=False)
    @classmethod
    def _empty_hot_gib(cls, v: object) -> object:
        # "" is the documented "unset"; "None" is what child_env writes for it
        return None if isinstance(v, str) and v.strip() in ("", "None") else v

    @field_validator("gpu_workers", check_fields=False)
    @classmethod
    def _gpu_workers(cls, v: str) -> str:
        ids = [w.strip() for w in v.split(",") if w.strip()]
        if ids != ["*"]:
            for w in ids:
                try:
                    check_id("worker id", w)
                except ConfigError as exc:
                    raise ValueError(str(exc)) from None
        return ",".join(ids)

    @field_validator("verify_remote", mode="before", check_fields=False)
    @classmethod
    def _legacy_verify(cls, v: object) -> object:
        # KVQ_VERIFY_REMOTE was a bool: 1/true meant "recompute every result", 0/false "none"
        if isinstance(v, bool) or (isinstance(v, str) and v.strip().lower() in _BOOLISH):
            on = v if isinstance(v, bool) else _BOOLISH[v.strip().lower()]
            return "all" if on else "off"
        if isinstance(v, str) and v not in ("sampled", "all", "off"):
            raise ValueError("must be sampled, all or off (1/true = all, 0/false = off)")
        return v

    @model_validator(mode="after")
    def _check_activations(self) -> SettingsChecks:
        """int8 activations apply to the CPU kernels on quantized weights; a GPU dtype does not
        use them. Asking for both is a contradiction; the default with a GPU dtype is not."""
        dtype, act = getattr(self, "compute_dtype", "auto"), getattr(self, "activations", "int8")
        if (
            "activations" in self.model_fields_set
            and act == "int8"
            and dtype
            not in (
                "auto",
                "float32",
            )
        ):
            raise ValueError(
                f"KVQ_ACTIVATIONS=int8 applies to the float32 kernels; KVQ_COMPUTE_DTYPE={dtype} "
                "does not use them: set KVQ_COMPUTE_DTYPE=auto or float32, or leave "
                "KVQ_ACTIVATIONS unset"
            )
        return self

    @model_validator(mode="after")
    def _check_tls_weakening(self) -> SettingsChecks:
        """A Redis URL option that turns certificate checks off needs KVQ_TLS_INSECURE too: a
        URL is copied around, and a copied `?ssl_cert_reqs=none` must not weaken TLS silently."""
        url = getattr(self, "redis_url", "")
        weak = tls_weakening(url)
        if weak and not getattr(self, "tls_insecure", False):
            raise ValueError(
                f"KVQ_REDIS_URL has {weak}, which turns off the check of the Redis server's "
                "certificate: set KVQ_TLS_INSECURE=1 to mean it, or remove it from the URL"
            )
        return self

    @field_validator("redis_url", "rq_url", check_fields=False)
    @classmethod
    def _check_url(cls, v: str, info: ValidationInfo) -> str:
        if info.field_name == "rq_url" and v == "":
            return v
        if info.field_name == "rq_url" and mode_of_url(v) != "standalone":
            raise ValueError("RQ is not cluster-safe: give a standalone redis:// URL")
        parsed = urlparse(v)
        if parsed.scheme not in _REDIS_SCHEMES:
            raise ValueError(
                f"must be a URL with scheme {', '.join(s + '://' for s in _REDIS_SCHEMES)}"
                f" such as redis://127.0.0.1:6379/0"
            )
        if parsed.scheme != "unix" and not parsed.hostname:
            raise ValueError("must name a host, e.g. redis://127.0.0.1:6379/0")
        try:
            parsed.port  # noqa: B018 - raises on a port out of range or not a number
        except ValueError:
            raise ValueError("the port must be a number in [0, 65535]") from None
        return v

    @field_validator("redis_mode", check_fields=False)
    @classmethod
    def _check_mode(cls, v: str, info: ValidationInfo) -> str:
        url = info.data.get("redis_url")
        if url is None:
            return v
        implied = mode_of_url(url)
        if v != "auto" and implied != "standalone" and implied != v:
            raise ValueError(f"{v} contradicts KVQ_REDIS_URL's scheme, which says {implied}")
        mode = implied if v == "auto" else v
        if mode != "standalone" and urlparse(url).scheme == "unix":
            raise ValueError(f"{mode} needs host:port URLs, not unix://")
        if mode == "sentinel" and not urlparse(url).path.strip("/"):
            raise ValueError(
                "sentinel needs the master's name: redis+sentinel://host:26379/mymaster"
            )
        return v

    @field_validator("tls_key_file", check_fields=False)
    @classmethod
    def _cert_with_key(cls, v: str, info: ValidationInfo) -> str:
        if bool(v) != bool(info.data.get("tls_cert_file")):
            raise ValueError("KVQ_TLS_CERT_FILE and KVQ_TLS_KEY_FILE go together: set both or none")
        return v

    @field_validator("tls_ca_file", "tls_cert_file", "tls_key_file", check_fields=False)
    @classmethod
    def _readable(cls, v: str) -> str:
        if v and not os.path.isfile(v):
            raise ValueError("must be the path of a readable PEM file")
        return v

    @field_validator("prefix", check_fields=False)
    @classmethod
    def _check_prefix(cls, v: str) -> str:
        if not v or any(c in v for c in "{}: \t\n"):
            raise ValueError("must be non-empty, without spaces, ':' or braces")
        return v

    @field_validator("api_keys", check_fields=False)
    @classmethod
    def _check_api_keys(cls, v: str) -> str:
        for key in (k.strip() for k in v.split(",")):
            if key and (len(key) < 8 or any(c.isspace() or not c.isprintable() for c in key)):
                raise ValueError(
                    "must be comma-separated tokens of at least 8 printable characters "
                    "without spaces"
                )
        return v

    @field_validator("monitor_tokens", check_fields=False)
    @classmethod
    def _check_monitor_tokens(cls, v: str) -> str:
        operator_tokens(v)
        return v

    @field_validator("api_max_tokens_default", check_fields=False)
    @classmethod
    def _default_in_limit(cls, v: int, info: ValidationInfo) -> int:
        limit = info.data.get("max_tokens_limit")
        if limit is not None and v > limit:
            raise ValueError(f"must be <= KVQ_MAX_TOKENS_LIMIT ({limit})")
        return v

    @field_validator("device", check_fields=False)
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", v):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return v

    @field_validator("monitor_lease_s", check_fields=False)
    @classmethod
    def _outlasts_a_poll(cls, v: float, info: ValidationInfo) -> float:
        poll = info.data.get("monitor_poll_s")
        if poll is not None and v <= poll:
            raise ValueError(
                f"must be > KVQ_MONITOR_POLL_S ({poll}): the active monitor renews it each poll"
            )
        return v

    @field_validator("saturation_threshold", "microbatches", check_fields=False)
    @classmethod
    def _within_slots(cls, v: int, info: ValidationInfo) -> int:
        n_slots = info.data.get("n_slots")
        if n_slots is not None and v > n_slots:
            raise ValueError(
                f"must be <= KVQ_N_SLOTS ({n_slots}){_WHY_WITHIN_SLOTS.get(info.field_name or '', '')}"
            )
        return v


_OPERATOR = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def operator_tokens(text: str) -> dict[str, str]:
    """`KVQ_MONITOR_TOKENS` (`name=token`, comma-separated) as token -> operator name;
    ValueError saying the form."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        name, eq, token = part.partition("=")
        if part and (
            not eq
            or not _OPERATOR.fullmatch(name)
            or len(token) < 16
            or any(c.isspace() or not c.isprintable() for c in token)
        ):
            raise ValueError(
                "must be name=token pairs, comma-separated: a name of 1 to 64 of A-Z a-z "
                "0-9 _ . @ -, a token of at least 16 printable characters without spaces "
                "(e.g. alice=$(openssl rand -hex 16))"
            )
        if part:
            out[token] = name
    return out
