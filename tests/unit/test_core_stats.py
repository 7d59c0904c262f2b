"""``CoreStats``'s sample windows: a numpy ring buffer that must answer exactly as the bounded deque
and sorted-copy percentiles it replaced (median of the two middle samples, p99 at rank int(0.99 n))."""

from __future__ import annotations

import math
import random
import statistics
from collections import deque

from fuseserve.scheduler.core_stats import CoreStats, SampleWindow


def expected_ms(samples) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s) * 1e3, s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3


def test_window_matches_a_bounded_deque_and_sorted_percentiles():
    rng = random.Random(0)
    for size in (1, 7, 100):
        for _ in range(200):
            window, ref = SampleWindow(size), deque(maxlen=size)
            for _ in range(rng.randint(0, 30)):
                x = rng.random()
                if rng.random() < 0.5:
                    window.append(x)
                    ref.append(x)
                else:
                    k = rng.randint(0, 2 * size + 3)
                    window.add(x, k)
                    ref.extend([x] * k)
                assert len(window) == len(ref)
                k = rng.randint(0, len(ref) + 2)
                assert window.last(k) == list(reversed(ref))[:k]
                assert sorted(window.values().tolist()) == sorted(ref)
                if ref:
                    p50, p99 = window.p50_p99_ms()
                    e50, e99 = expected_ms(ref)
                    assert math.isclose(p50, e50) and p99 == e99


def test_empty_window_is_nan_and_cached_result_follows_new_samples():
    stats = CoreStats()
    assert all(math.isnan(v) for v in stats.cpu_per_step_ms() + stats.idle_ms())
    stats.add_cpu(0.004, 2)  # 2 ms each
    assert stats.cpu_per_step_ms() == (2.0, 2.0)
    stats.add_cpu(0.010, 1)
    assert stats.cpu_per_step_ms() == (2.0, 10.0)
    stats.idle_s.append(0.001)
    assert stats.idle_ms() == (1.0, 1.0)
