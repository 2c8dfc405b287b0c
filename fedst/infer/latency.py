"""Per-frame latency of an inference as an operating room judges it: p50 / p90 / p99 / max of the
read, network, write and end-to-end times over the frames after a warm-up, and the pacing of the
input (:class:`PacedFrames`: a file read at its frame rate, as a camera delivers it, counting
the frames dropped because the pipeline was still busy when a newer one arrived).

NVIDIA Holoscan's reference applications report latency the same way (percentiles and maximum of
the end-to-end time, input in real time or as fast as possible); the mean FPS hides the worst
frames that a surgeon sees as stutter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "LATENCY_STAGES",
    "PERCENTILES",
    "PacedFrames",
    "format_latency",
    "latency_percentiles",
    "latency_report",
]

PERCENTILES: tuple[int, ...] = (50, 90, 99)
LATENCY_STAGES: tuple[str, ...] = ("read", "network", "write", "total")
"""timing.csv's stages; "total" is the end-to-end time of a frame (with realtime=true from its
arrival, so it includes the wait for the pipeline)."""


def latency_percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    """{"p50", "p90", "p99", "max"} of ``samples_ms`` (numpy's linear interpolation between
    order statistics). ValueError for no sample: a percentile of nothing is not a number."""
    values = np.asarray(samples_ms, dtype=np.float64)
    if values.size == 0:
        raise ValueError("latency percentiles need at least one timed frame")
    result = {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}
    result["max"] = float(values.max())
    return result


def latency_report(stage_ms: dict[str, Sequence[float]], warmup: int) -> dict[str, dict] | None:
    """Per stage the percentiles of its times after the first ``warmup`` frames; None when no
    frame is left after the warm-up (the caller says so)."""
    if warmup < 0:
        raise ValueError(f"warm-up frames must be >= 0, got {warmup}")
    kept = {stage: list(ms)[warmup:] for stage, ms in stage_ms.items()}
    if not any(kept.values()):
        return None
    return {stage: latency_percentiles(ms) for stage, ms in kept.items()}


def format_latency(report: dict[str, dict]) -> list[str]:
    """One line per stage: ``network  p50 12.3  p90 14.0  p99 20.1  max 25.6 ms``."""
    width = max(map(len, report))
    return [
        f"{stage:<{width}}  " + "  ".join(f"{k} {v:.1f}" for k, v in values.items()) + " ms"
        for stage, values in report.items()
    ]


@dataclass
class PacedFrame:
    """A frame as a paced reader hands it over: its time in the video (s), RGB uint8 [H, W, 3]
    and the wall-clock second (``clock``'s) it arrived."""

    time_s: float
    rgb: np.ndarray
    arrival: float


class PacedFrames:
    """The frames of a file delivered at their own times, as a camera would: frame k arrives
    ``time_k - time_0`` seconds after the first is asked for. Asked for a frame, the reader
    waits for the next one if it has not arrived yet; if several have arrived meanwhile, it hands
    over the newest and counts the older ones as dropped (a camera overwrites its buffer). Each
    frame is decoded to be seen, dropped ones too, so decoding counts in the read time.
    ``clock`` / ``sleep`` are injectable for tests."""

    def __init__(
        self,
        frames: Iterator[tuple[float, np.ndarray]],
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._frames = frames
        self._clock = clock
        self._sleep = sleep
        self._start: float | None = None
        self._first_time = 0.0
        self._ahead: tuple[float, np.ndarray] | None = None
        self.dropped = 0
        """Frames that arrived and were replaced by a newer one before the reader asked."""

    def _arrival(self, time_s: float) -> float:
        assert self._start is not None
        return self._start + time_s - self._first_time

    def _pull(self) -> tuple[float, np.ndarray] | None:
        item, self._ahead = self._ahead, None
        return item if item is not None else next(self._frames, None)

    def __iter__(self) -> PacedFrames:
        return self

    def __next__(self) -> PacedFrame:
        item = self._pull()
        if item is None:
            raise StopIteration
        if self._start is None:
            self._start, self._first_time = self._clock(), item[0]
        wait = self._arrival(item[0]) - self._clock()
        if wait > 0:
            self._sleep(wait)
            return PacedFrame(item[0], item[1], self._arrival(item[0]))
        while True:  # behind: skip to the newest frame that has arrived
            newer = next(self._frames, None)
            if newer is None or self._arrival(newer[0]) > self._clock():
                self._ahead = newer
                return PacedFrame(item[0], item[1], self._arrival(item[0]))
            self.dropped += 1
            item = newer
