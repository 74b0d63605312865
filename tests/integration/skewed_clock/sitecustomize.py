"""Put this folder on a child Python's PYTHONPATH and set SKEWED_CLOCK_S: its wall clock
(`time.time`, `time.time_ns`) is that many seconds off, as on a host whose clock is set wrong.
Only the tests use it (`test_e2e_clock_skew.py`); kvq has no setting for it."""

import os
import time

_SKEW_S = float(os.environ.get("SKEWED_CLOCK_S", "0"))
if _SKEW_S:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _SKEW_S
    time.time_ns = lambda: _time_ns() + int(_SKEW_S * 1e9)
