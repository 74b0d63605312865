"""The monitor's sampled metrics over time (`kvq.monitor.history.History`): every sample of
the last `WINDOW_S`, older ones thinned back to `keep_s` (`KVQ_MONITOR_HISTORY_S`), a bounded
count of samples whatever `keep_s`, and the range the charts ask for."""

from __future__ import annotations

import pytest

from kvq.config import load_settings
from kvq.errors import ConfigError
from kvq.monitor.history import (
    MAX_SAMPLES,
    OLD_POINTS,
    SAMPLE_S,
    WINDOW_S,
    History,
    chart_range,
    since,
)

T0 = 1.8e9


def counting() -> History:
    """A History whose registry is one counter of the samples taken so far."""
    n = [0.0]

    def read() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        n[0] += 1
        return {("n_total", ()): n[0]}

    return History(read, keep_s=3600.0)


def run(h: History, seconds: float, every: float = SAMPLE_S, start: float = T0) -> float:
    t = start
    while t <= start + seconds:
        h.take(t)
        t += every
    return t - every


def test_the_last_window_is_kept_at_full_rate_and_older_samples_thinned() -> None:
    h = counting()
    end = run(h, 3 * 3600)
    got = h.samples(None)
    times = [s.t for s in got]
    assert times == sorted(times) and times[-1] == end
    assert end - times[0] <= 3600.0, "nothing older than keep_s"
    assert end - times[0] > 3600.0 - 2 * h.step_s, "back to about keep_s"
    recent = [t for t in times if end - t <= WINDOW_S]
    assert len(recent) == WINDOW_S / SAMPLE_S + 1, "every sample of the last 10 minutes"
    old = [t for t in times if end - t > WINDOW_S]
    assert h.step_s == (3600.0 - WINDOW_S) / OLD_POINTS == 12.5
    gaps = [b - a for a, b in zip(old, old[1:], strict=False)]
    assert gaps and min(gaps) >= h.step_s and max(gaps) <= h.step_s + SAMPLE_S
    assert len(got) <= MAX_SAMPLES


@pytest.mark.parametrize("keep_s", [WINDOW_S, 3600.0, 86400.0, 7 * 86400.0])
def test_the_count_of_samples_is_bounded_whatever_is_kept(keep_s: float) -> None:
    h = History(lambda: {}, keep_s=keep_s)
    t, most = T0, 0
    for _ in range(int(min(keep_s, 86400.0) * 1.5 / SAMPLE_S)):
        h.take(t)
        t += SAMPLE_S
        most = max(most, len(h.samples(None)))
    assert most <= MAX_SAMPLES == 393


def test_a_page_polling_between_ticks_does_not_grow_the_history() -> None:
    h = counting()
    for i in range(600):  # a sample every 0.5 s for 5 minutes (pages asking for fresh data)
        h.take(T0 + 0.5 * i)
    got = h.samples(None)
    assert len(got) <= 300 / (0.8 * SAMPLE_S) + 2, "about one sample per tick, and the newest"
    assert got[-1].t == T0 + 0.5 * 599 and got[-1].series[("n_total", ())] == 600
    gaps = [b.t - a.t for a, b in zip(got, got[1:-1], strict=False)]
    assert min(gaps) >= 0.8 * SAMPLE_S


def test_a_range_returns_the_samples_of_its_last_seconds() -> None:
    h = counting()
    end = run(h, 2 * 3600)
    ten = h.samples()  # the default: WINDOW_S, what the alert rules read
    assert [s.t for s in ten] == [s.t for s in h.samples(WINDOW_S)]
    assert end - ten[0].t == WINDOW_S and ten[-1].t == end
    hour = h.samples(3600.0)
    assert end - hour[0].t <= 3600.0 < end - hour[0].t + 2 * h.step_s
    assert [s.t for s in hour] == [s.t for s in h.samples(None)], "all kept is an hour"
    assert [s.t for s in h.samples(1800.0)] == [s.t for s in hour if end - s.t <= 1800.0]
    assert [s.t for s in h.samples(60.0)] == [end - 5 * i for i in range(12, -1, -1)]
    assert [s.t for s in h.samples(0.0)] == [end]


def test_alert_windows_read_the_last_ten_minutes_whatever_is_kept() -> None:
    h = counting()
    end = run(h, 3600)
    pair = since(h.samples(), 300.0)
    assert pair is not None and pair[1].t - pair[0].t == 300.0 and pair[1].t == end
    first, last = since(h.samples(), WINDOW_S) or (None, None)
    assert first is not None and last is not None and last.t - first.t == WINDOW_S


def test_chart_range() -> None:
    got = chart_range(T0, 3600.0, 7200.0)
    assert got == {"from": T0 - 3600.0, "to": T0, "seconds": 3600.0, "kept_s": 7200.0}


@pytest.mark.parametrize("bad", ["10", "599", "604801", "an hour", "nan"])
def test_kvq_monitor_history_s_is_validated(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVQ_MONITOR_HISTORY_S", bad)
    with pytest.raises(ConfigError, match="KVQ_MONITOR_HISTORY_S"):
        load_settings()


def test_kvq_monitor_history_s_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVQ_MONITOR_HISTORY_S", raising=False)
    assert load_settings().monitor_history_s == 3600.0
    monkeypatch.setenv("KVQ_MONITOR_HISTORY_S", "86400")
    assert load_settings().monitor_history_s == 86400.0
