"""What a clip is: :class:`ClipConfig` (frames per clip, their spacing in seconds, the input size)
and which frames of a video make the clip ending at a frame: :func:`clip_frame_positions` for a
stored video (the latest frame at or before each target time, the current frame before the video
starts) and :class:`FrameHistory`, the same rule for frames arriving one by one (streaming)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

TIME_TOLERANCE_S = 1e-6


def clip_frame_positions(
    times: Sequence[float], current: int, num_frames: int, interval_s: float
) -> list[int]:
    """Positions in ``times`` of the clip ending at ``current``, oldest first (length num_frames).

    Frame k steps back targets ``times[current] - k * interval_s``: the latest frame at or before it
    (within 1e-6 s); a target before the video's first frame gives the current frame (Sec. IV-A3).
    """
    if not 0 <= current < len(times):
        raise IndexError(f"current frame {current} outside a video of {len(times)} frames")
    positions = []
    for steps_back in range(num_frames - 1, 0, -1):
        target = times[current] - steps_back * interval_s
        latest = bisect.bisect_right(times, target + TIME_TOLERANCE_S) - 1
        positions.append(latest if latest >= 0 else current)
    positions.append(current)
    return positions


class FrameHistory:
    """:func:`clip_frame_positions` for a stream: frames arrive one by one with their times.

    Holds one item per earlier frame (e.g. its encoder features) and, for a new frame at time t,
    returns the items the clip ending at it uses: frame k steps back is the latest earlier frame at
    or before ``t - k * interval_s``, or the new frame itself (``None``) when that time is before
    the stream's first frame. Items no future clip can use are dropped, so memory stays at about
    ``(num_frames - 1) * interval_s * fps + 1`` items.
    """

    def __init__(self, num_frames: int, interval_s: float) -> None:
        if num_frames < 1 or interval_s < 0:
            raise ValueError(
                f"FrameHistory needs num_frames >= 1 and interval_s >= 0, got {num_frames}, "
                f"{interval_s}"
            )
        self.num_frames, self.interval_s = num_frames, interval_s
        self.times: list[float] = []
        self.items: list[Any] = []

    def __len__(self) -> int:
        return len(self.items)

    def reset(self) -> None:
        """Forget every frame (start of a new video)."""
        self.times.clear()
        self.items.clear()

    def context(self, time_s: float) -> list[Any | None]:
        """The ``num_frames - 1`` earlier items of a new frame at ``time_s``, oldest first;
        ``None`` where the clip uses the new frame itself."""
        if self.times and time_s <= self.times[-1]:
            raise ValueError(f"frame times must increase: got {time_s} s after {self.times[-1]} s")
        current = len(self.times)
        positions = clip_frame_positions(
            [*self.times, time_s], current, self.num_frames, self.interval_s
        )
        return [None if p == current else self.items[p] for p in positions[:-1]]

    def append(self, time_s: float, item: Any) -> None:
        """Add the new frame's item (after :meth:`context`), then drop items no later clip needs:
        the oldest item goes once the next one is at or before the oldest target time, as later
        frames' targets are later still."""
        if self.times and time_s <= self.times[-1]:
            raise ValueError(f"frame times must increase: got {time_s} s after {self.times[-1]} s")
        self.times.append(time_s)
        self.items.append(item)
        oldest_target = time_s - (self.num_frames - 1) * self.interval_s + TIME_TOLERANCE_S
        while len(self.times) > 1 and self.times[1] <= oldest_target:
            del self.times[0], self.items[0]
