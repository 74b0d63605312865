"""The worker: volunteers for a slice, downloads it, serves its inbox (outbound only)."""

from kvq.worker.service import Worker

__all__ = ["Worker"]
