"""The monitor: control plane for saturation, demand and dead workers."""

from kvq.monitor.service import ModelState, Monitor

__all__ = ["ModelState", "Monitor"]
