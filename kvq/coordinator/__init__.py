"""The coordinator: backbone, continuous batching and per-slice expert dispatch."""

from kvq.coordinator.service import Coordinator

__all__ = ["Coordinator"]
