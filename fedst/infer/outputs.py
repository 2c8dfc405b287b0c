"""What an inference writes: the overlay video with its legend, the label maps, timing.csv and
summary.json, staged under temporary names and renamed together when the run completes
(:class:`StagedOutputs`)."""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from fedst.infer.command import InferConfig, InferenceError
from fedst.infer.latency import LATENCY_STAGES, latency_report
from fedst.infer.video import VideoInput
from fedst.report.plots import PART_COLORS

log = logging.getLogger("fedst.infer")

VIDEO_FOURCC = "mp4v"
OVERLAY, TIMING, SUMMARY, LABELS = "overlay.mp4", "timing.csv", "summary.json", "labels"
TIMING_COLUMNS = ("frame", "time_s", "read_ms", "network_ms", "write_ms", "total_ms")


def draw_legend(image_rgb: np.ndarray, palette=PART_COLORS) -> np.ndarray:
    """Class colour swatches and names in the top-left corner of an RGB uint8 image (in place)."""
    height = image_rgb.shape[0]
    scale = max(0.3, height / 720 * 0.6)
    thickness = max(1, round(scale * 1.5))
    line = max(8, round(26 * scale / 0.6))
    swatch = max(4, round(line * 0.6))
    width = max(
        cv2.getTextSize(n, cv2.FONT_HERSHEY_SIMPLEX, scale, thickness)[0][0]
        for n, _ in palette.values()
    )
    panel_w, panel_h = swatch + width + line // 2 + 8, line * len(palette) + 6
    panel = image_rgb[:panel_h, :panel_w]
    panel[:] = (panel.astype(np.float32) * 0.4).astype(np.uint8)  # darken behind the legend
    for row, (name, color) in enumerate(palette.values()):
        top = 4 + row * line
        cv2.rectangle(image_rgb, (4, top), (4 + swatch, top + swatch), color, thickness=-1)
        cv2.putText(
            image_rgb,
            name,
            (8 + swatch, top + swatch),
            cv2.FONT_HERSHEY_SIMPLEX,
            scale,
            (255, 255, 255),
            thickness,
            cv2.LINE_AA,
        )
    return image_rgb


class StagedOutputs:
    """The output files of one inference run, written in ``out_dir`` under temporary names
    (``.overlay.<random>.tmp.mp4``, ``.labels.<random>.tmp/``) and renamed to their own names
    when the ``with`` block ends without an error: the label maps first, then the files in the
    order they were asked for (summary.json last). On an error they are deleted, with the
    folders this run created if they stayed empty, so a failed run leaves the folder as it was
    and never mixes its files with an earlier run's."""

    def __init__(self, out_dir: Path, labels: bool = False):
        self.out_dir = out_dir
        self.labels: Path | None = None
        """The temporary folder of the label maps (labels=true), inside the ``with`` block."""
        self._want_labels = labels
        self._created = [p for p in (out_dir, *out_dir.parents) if not p.exists()]  # deepest first
        self._files: dict[str, Path] = {}  # own name -> temporary path

    def __enter__(self) -> StagedOutputs:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self._want_labels:
            self.labels = self._temporary(LABELS)
            self.labels.mkdir()
        return self

    def file(self, name: str) -> Path:
        """Where to write the output ``name`` (a temporary path with the same suffix: OpenCV
        picks the container by it); it becomes ``out_dir / name`` at the end."""
        self._files[name] = self._temporary(name)
        return self._files[name]

    def _temporary(self, name: str) -> Path:
        stem, suffix = Path(name).stem, Path(name).suffix
        return self.out_dir / f".{stem}.{uuid.uuid4().hex[:12]}.tmp{suffix}"

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self._commit()
        else:
            self._discard()

    def _commit(self) -> None:
        if self.labels is not None:
            final, old = self.out_dir / LABELS, self._temporary(f"{LABELS}.old")
            if final.exists():  # an earlier run's label maps: replaced, not mixed with these
                os.replace(final, old)
            os.replace(self.labels, final)
            shutil.rmtree(old, ignore_errors=True)
        for name, tmp in self._files.items():
            os.replace(tmp, self.out_dir / name)

    def _discard(self) -> None:
        for tmp in self._files.values():
            tmp.unlink(missing_ok=True)
        if self.labels is not None:
            shutil.rmtree(self.labels, ignore_errors=True)
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:  # not empty: other files are there too
                break


def open_overlay_writer(path: Path, fps: float, frame_size: tuple[int, int]) -> cv2.VideoWriter:
    height, width = frame_size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*VIDEO_FOURCC), fps, (width, height))
    if not writer.isOpened():
        raise InferenceError(
            f"OpenCV cannot write {path.parent / OVERLAY} ({VIDEO_FOURCC}, {width}x{height}); "
            f"check that the folder is writable and OpenCV has FFmpeg (cv2.getBuildInformation())"
        )
    return writer


def write_summary(
    cfg: InferConfig,
    source: VideoInput,
    outputs: StagedOutputs,
    rows: list[tuple],
    frame_size: tuple[int, int],
    started: float,
    guard: dict[str, str] | None,
    network: dict[str, Any],
    pacing: dict[str, Any],
) -> dict[str, Any]:
    """Write timing.csv and summary.json (staged in ``outputs``) and return the summary.

    ``rows``: per frame (index, time_s, read, network, write, total seconds); ``pacing``:
    {"realtime", "dropped_frames"}. summary.json's "latency_ms" holds p50 / p90 / p99 / max per
    stage over the frames after ``cfg.warmup_frames`` (null, with a warning, when none is left)."""
    with open(outputs.file(TIMING), "w", newline="") as handle:
        table = csv.writer(handle)
        table.writerow(TIMING_COLUMNS)
        for index, time_s, *seconds in rows:
            table.writerow([index, f"{time_s:.4f}", *(f"{s * 1e3:.2f}" for s in seconds)])
    network_s = np.array([r[3] for r in rows])
    stage_ms = {stage: [r[2 + i] * 1e3 for r in rows] for i, stage in enumerate(LATENCY_STAGES)}
    latency = latency_report(stage_ms, cfg.warmup_frames)
    if latency is None:
        log.warning(
            "%d frame(s), none after the %d warm-up frame(s): no latency percentiles (lower "
            "warmup_frames= or read more frames)",
            len(rows),
            cfg.warmup_frames,
        )
    out_dir = outputs.out_dir
    summary = {
        "input": source.name,
        "site": cfg.site,
        "guard": guard,
        "network": network,
        "frames": len(rows),
        "frame_size": list(frame_size),
        "fps_input": source.fps,
        "fps_overall": len(rows) / (time.perf_counter() - started),
        "fps_network_mean": float(1 / network_s.mean()),
        "network_ms_median": float(np.median(network_s) * 1e3),
        **pacing,
        "warmup_frames": cfg.warmup_frames,
        "latency_ms": latency,
        "overlay": str(out_dir / OVERLAY),
        "labels": str(out_dir / LABELS) if cfg.labels else None,
        "timing": str(out_dir / TIMING),
    }
    outputs.file(SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary
