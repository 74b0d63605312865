"""The monitor: control plane for saturation, demand and dead workers."""

from kvq.bus.records import ModelState
from kvq.monitor.service import Monitor

__all__ = ["ModelState", "Monitor"]
