"""kvq's exceptions: one tree, one branch per layer.

    KvqError
    ├── ConfigError        a setting is missing or out of range (names the setting)
    ├── WireError          a message cannot be decoded or fails validation
    ├── BusError           Redis transport problems that survived reconnection
    ├── ModelError         a GGUF file, tensor or slice kvq cannot use
    │   └── SliceIntegrityError   downloaded slice bytes do not match what was published
    ├── RoutingError       no node can serve a slice; unknown model
    └── ServerError        the embedded Redis server could not be started

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


class ModelError(KvqError):
    """A model file, tensor, architecture or quantization kvq cannot use."""


class SliceIntegrityError(ModelError):
    """Slice bytes do not match the size or checksum published for them."""


class RoutingError(KvqError):
    """No node can serve what was asked (unknown model, uncovered slice)."""


class ServerError(KvqError):
    """The embedded Redis server could not be started or stopped."""
