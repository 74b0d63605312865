"""kvq's exceptions: one tree, one branch per layer.

    KvqError
    ├── ConfigError        a setting is missing or out of range (names the setting)
    ├── WireError          a message cannot be decoded or fails validation
    │   └── BadJob             a well-formed job this expert server cannot serve
    ├── BusError           Redis transport problems that survived reconnection
    │   ├── IdentityInUse      another live process already serves under this worker id
    │   └── TlsError           the TLS handshake failed (wrong CA, certificate or key)
    ├── ModelError         a GGUF file, tensor or slice kvq cannot use
    │   ├── SliceIntegrityError   downloaded slice bytes do not match what was published
    │   │   └── TamperedSource        the source's bytes differ from the published checksums
    │   ├── ModelMismatch         a coordinator's GGUF is not the file registered for its id
    │   │   └── ModelCorrupt          ... a range of it fails its checksum (checked before blame)
    │   ├── ModelInUse            `kvq model rm` of a model a live coordinator serves
    │   └── ModelRemoved          a coordinator's model was removed (`kvq model rm --force`)
    ├── BankError          a hot/cold bank or hot-set plan cannot be built or updated
    ├── RoutingError       no node can serve a slice; unknown model
    │   ├── UnknownModel       no model of that id in the swarm
    │   ├── UnknownNode        no node of that id in the swarm
    │   ├── NoRoute            every copy of the model has a down node
    │   ├── Unrecoverable      failover ladder exhausted (H6 d): expected, never an invalid route
    │   ├── UncoveredSlice     a slice has no live node: refuse the model's requests
    │   │   └── NoReplica          ... and a backbone-only coordinator waited for one in vain
    │   ├── CapacityError      the nodes' memory cannot hold one copy of a model
    │   └── TopologyError      a swarm topology or plan is malformed or invalid
    ├── ServerError        the embedded Redis server could not be started
    ├── ChildDied          a child process of `kvq demo` exited while the caller waited on it
    ├── RequestFailed      the coordinator answered a request with an error event
    ├── ApiError           an HTTP request `kvq api` answers with an error status
    └── HttpError          an HTTP request the monitor answers with an error status

`TamperedSource` (`kvq.worker.loader`) and `RequestFailed` (`kvq.client`) live beside the data
they carry; every other class is here. `tests/unit/test_errors.py` holds that every exception
class of kvq is in this tree.

Every message carries the bad value and what to do about it.
"""

from __future__ import annotations


class KvqError(Exception):
    """Base of every error kvq raises on purpose."""


class ConfigError(KvqError):
    """A setting is invalid; the message names it and the allowed values."""


class WireError(KvqError):
    """A message could not be decoded or validated.

    `retryable` is False: the same bytes will fail the same way, so such entries go to the
    dead-letter stream instead of being retried.
    """

    retryable = False


class BusError(KvqError):
    """Talking to Redis failed after the reconnect policy gave up."""


class IdentityInUse(BusError):
    """Another live process beats under this worker id: pick another `--id` (or stop it)."""


class TlsError(BusError):
    """The TLS connection to Redis failed in a way retrying cannot fix (certificate, CA)."""


class ModelError(KvqError):
    """A model file, tensor, architecture or quantization kvq cannot use."""


class SliceIntegrityError(ModelError):
    """Slice bytes do not match the size or checksum published for them."""


class ModelMismatch(ModelError):
    """A coordinator's model file differs (size, metadata hash, expert bytes) from the file
    the monitor registered under the same model id."""


class ModelCorrupt(ModelMismatch):
    """A byte range of the coordinator's own model file does not match the registration's
    checksum: found before a mismatch on that slice is charged to a worker."""


class ModelInUse(ModelError):
    """A model cannot be removed: a live coordinator serves it (`kvq model rm --force`)."""


class ModelRemoved(ModelError):
    """The model a coordinator serves was removed while it ran (`kvq model rm --force`): it
    ends its requests with this error and exits."""


class BankError(KvqError):
    """A routing histogram, hot-set plan or bank update is invalid (names the layer/expert)."""


class RoutingError(KvqError):
    """No node can serve what was asked (unknown model, uncovered slice)."""


class UnknownModel(RoutingError):
    """A model id the swarm does not serve; the message lists the ones it does."""


class UnknownNode(RoutingError):
    """A node id the swarm does not know; the message lists the ones it does."""


class NoRoute(RoutingError):
    """Every copy of the model has a down node: nothing to route to until failover or repair."""


class Unrecoverable(RoutingError):
    """The failover ladder (copy, splice, degradation) found nothing: a controlled outcome."""


class UncoveredSlice(RoutingError):
    """A slice of the model has no live node, so the model cannot be served until it does."""


class NoReplica(UncoveredSlice):
    """A backbone-only coordinator needs a slice that no live worker serves, and none came
    within `KVQ_REPLICA_WAIT_S`: the requests of that step end with this error."""


class CapacityError(RoutingError):
    """The nodes' memory cannot hold even one copy of a model."""


class TopologyError(RoutingError):
    """A topology file, node profile or plan is malformed; the message names the field."""


class ServerError(KvqError):
    """The embedded Redis server could not be started or stopped."""


class ChildDied(KvqError):
    """A child process exited while the caller waited on something it should provide."""


class BadJob(WireError):
    """A well-formed job that this server cannot serve (another slice, model or shape)."""


class HttpError(KvqError):
    """An answer of the monitor's HTTP API other than 2xx, sent as `{type, message, retryable}`
    (`status` is an `http.HTTPStatus`)."""

    def __init__(self, status: int, kind: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.status, self.kind, self.retryable = status, kind, retryable


class ApiError(KvqError):
    """An HTTP answer other than 2xx from `kvq api`, sent in OpenAI's error shape
    `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": str(self),
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }
