"""Specification of fedst.infer.latency: percentiles by hand, the warm-up, and a file paced as a
camera delivers it (a fake clock: which frames are handed over, which are dropped)."""

from __future__ import annotations

import numpy as np
import pytest

from fedst.infer.latency import PacedFrames, latency_percentiles, latency_report


def test_percentiles_interpolate_between_order_statistics():
    # 1..100 ms: p50 at rank 49.5 -> 50.5; p90 at rank 89.1 -> 90.1; p99 at 98.01 -> 99.01
    result = latency_percentiles(list(range(1, 101)))
    assert result == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01, "max": 100.0})


def test_the_warm_up_frames_are_left_out_and_none_left_is_said():
    stages = {"network": [500.0, 400.0, 10.0, 20.0, 30.0], "total": [600.0, 500.0, 11, 21, 31]}
    report = latency_report(stages, warmup=2)
    # after the warm-up: 10, 20, 30 -> p50 20, p90 at rank 1.8 -> 28, p99 at 1.98 -> 29.8
    assert report["network"] == pytest.approx({"p50": 20.0, "p90": 28.0, "p99": 29.8, "max": 30.0})
    assert report["total"]["max"] == pytest.approx(31.0)
    assert latency_report(stages, warmup=5) is None
    with pytest.raises(ValueError, match="at least one"):
        latency_percentiles([])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def video(times: list[float]):
    return ((t, np.full((2, 2, 3), i, dtype=np.uint8)) for i, t in enumerate(times))


def test_a_slow_pipeline_gets_the_newest_frame_and_the_skipped_ones_are_dropped():
    # frames every 0.125 s; each frame takes the pipeline 0.3 s. Asked at 0: frame 0. At 0.3:
    # 0.125 and 0.25 have arrived -> 0.25, one dropped. At 0.6: 0.375, 0.5 -> 0.5 (2 dropped).
    # At 0.9: 0.625, 0.75, 0.875 -> 0.875 (4 dropped). Then the file ends.
    times = [k * 0.125 for k in range(8)]
    clock = FakeClock()
    paced = PacedFrames(video(times), clock=clock, sleep=clock.sleep)
    handed = []
    for frame in paced:
        handed.append((frame.time_s, frame.arrival))
        clock.now += 0.3
    assert handed == [(0.0, 0.0), (0.25, 0.25), (0.5, 0.5), (0.875, 0.875)]
    assert paced.dropped == 4


def test_a_fast_pipeline_waits_for_each_frame_and_drops_none():
    times = [k * 0.125 for k in range(5)]
    clock = FakeClock()
    paced = PacedFrames(video(times), clock=clock, sleep=clock.sleep)
    handed = []
    for frame in paced:
        handed.append(frame.time_s)
        assert clock.now == pytest.approx(frame.arrival)  # waited until it arrived
        clock.now += 0.01
    assert handed == times and paced.dropped == 0
