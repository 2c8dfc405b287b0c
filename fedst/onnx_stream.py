"""The exported streaming step in ONNX Runtime on the CPU: sessions, the feature cache, file names.

:class:`OnnxStreamer` streams frames through a graph written by fedst/export.py (fp32, or int8
from fedst/quantize.py) with the host keeping the cache of earlier frames' features;
:class:`SessionSettings` are its ONNX Runtime session options; :func:`default_export_path` is
where fedst/export.py writes and fedst/infer/ (runtime=onnx or onnx-int8) looks. Needs onnxruntime (the export extra).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedst.data.clips import FrameHistory

__all__ = [
    "SUFFIXES",
    "OnnxStreamer",
    "SessionSettings",
    "context_input_name",
    "default_export_path",
    "export_command",
    "feature_output_name",
]

SUFFIXES = {"onnx": ".onnx", "onnx-int8": ".int8.onnx"}
"""File suffix of each export format."""


@dataclass(frozen=True)
class SessionSettings:
    """ONNX Runtime session options of :class:`OnnxStreamer`. The defaults are the fastest
    measured for streaming on the CPU (``python -m bench.onnx --session-options`` prints the
    comparison; docs/inference.md has the figures)."""

    optimization: str = "all"
    """Graph optimisation level: basic | extended | all (all: also the NCHWc conv layouts)."""
    arena: bool = True
    """ONNX Runtime's CPU memory arena (buffers reused across steps instead of allocated)."""
    memory_pattern: bool = True
    """Plan each step's buffers from the previous step's (the shapes never change)."""
    spinning: bool = False
    """Intra-op threads busy-wait for work after a step. Off: between two frames the host
    decodes, draws and writes (fedst.infer), and spinning threads would take those cores."""
    profile: str | None = None
    """File prefix for ONNX Runtime's profiler (a JSON trace per session); None: off."""

    def session_options(self, threads: int | None) -> Any:
        """The onnxruntime.SessionOptions: ``threads`` intra-op threads (None: one per physical
        core), one inter-op thread, sequential execution (one step is one chain of ops)."""
        import onnxruntime as ort

        levels = {
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }
        if self.optimization not in levels:
            raise ValueError(
                f"optimization={self.optimization!r} is not an ONNX Runtime graph optimisation "
                f"level; choose one of {sorted(levels)}"
            )
        options = ort.SessionOptions()
        options.graph_optimization_level = levels[self.optimization]
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.enable_cpu_mem_arena = self.arena
        options.enable_mem_pattern = self.memory_pattern
        if threads is not None:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", str(int(self.spinning)))
        if self.profile is not None:
            options.enable_profiling = True
            options.profile_file_prefix = self.profile
        return options


class OnnxStreamer:
    """Streams frames through an exported step (fp32 or int8) with ONNX Runtime on the CPU,
    keeping the feature cache on the host.

    ``step(frame [1, 3, H, W] float32, time_s) -> logits [1, K, H, W]`` (numpy), the same clip
    rule as :class:`fedst.model.network.StreamingState` with the sidecar's ``interval_s``.
    ``step`` = :meth:`feeds` (the graph's inputs at ``time_s``) then :meth:`run` (run them and
    cache this frame's features). ``runtime`` is "onnx" or "onnx-int8" (the sidecar says which).
    """

    def __init__(
        self, path: Path, threads: int | None = None, settings: SessionSettings = SessionSettings()
    ):
        import onnxruntime as ort

        self.path = Path(path)
        self.meta = json.loads(self.path.with_suffix(".json").read_text())
        self.runtime = "onnx-int8" if "quantization" in self.meta else "onnx"
        self.session = ort.InferenceSession(
            str(self.path), settings.session_options(threads), providers=["CPUExecutionProvider"]
        )
        self.stages = self.meta["temporal_stages"]
        self.num_frames = self.meta["num_frames"]
        self.history = FrameHistory(self.num_frames, self.meta["interval_s"])
        self._blank = {  # stage (or "decode_head") -> zeros of one earlier frame's map
            s: np.zeros(self.meta["inputs"][context_input_name(s)][1:], np.float32)
            for s in self.stages
        }

    def reset(self) -> None:
        self.history.reset()

    def feeds(self, frame: np.ndarray, time_s: float) -> dict[str, np.ndarray]:
        """The graph's inputs for a frame at ``time_s``: the frame, and per cache key (a temporal
        stage, or the decode head's fused map) the
        cached features of the clip's earlier frames stacked oldest first (zeros, flagged
        invalid in ``context_valid``, where the clip uses the frame itself)."""
        earlier = self.history.context(time_s)  # T-1 x ({stage: features} | None)
        feeds = {
            "frame": np.ascontiguousarray(frame, dtype=np.float32),
            "context_valid": np.array([e is not None for e in earlier]),
        }
        for s in self.stages:
            feeds[context_input_name(s)] = np.stack(
                [self._blank[s] if e is None else e[s] for e in earlier]
            )  # T-1 x [1, C, h, w] -> [T-1, 1, C, h, w]
        return feeds

    def run(self, feeds: dict[str, np.ndarray], time_s: float) -> np.ndarray:
        """Run the step on ``feeds`` (from :meth:`feeds` at ``time_s``); cache the features."""
        logits, *features = self.session.run(None, feeds)
        self.history.append(time_s, dict(zip(self.stages, features, strict=True)))
        return logits

    def step(self, frame: np.ndarray, time_s: float) -> np.ndarray:
        return self.run(self.feeds(frame, time_s), time_s)


def context_input_name(key: int | str) -> str:
    """The graph input of a cache key's earlier maps: ``context_s1`` for encoder stage 1,
    ``context_decode_head`` for the decode head's fused maps."""
    return f"context_s{key}" if isinstance(key, int) else f"context_{key}"


def feature_output_name(key: int | str) -> str:
    """The graph output of this frame's map of a cache key (``features_s1``, ``features_decode_head``)."""
    return f"features_s{key}" if isinstance(key, int) else f"features_{key}"


def default_export_path(run: Path, site: str, prompt_site: str | None, format: str) -> Path:
    """Where fedst/export.py writes by default and fedst/infer/ with ``runtime=<format>``
    looks: ``<run>/export/<site>.onnx`` (``.int8.onnx`` for onnx-int8; with a prompt site:
    ``<site>_<prompt_site>``, e.g. ``outfed_E``)."""
    name = f"{site}_{prompt_site}" if prompt_site else site
    return run / "export" / f"{name}{SUFFIXES[format]}"


def export_command(run: str, site: str, prompt_site: str | None, format: str) -> str:
    """The command that writes :func:`default_export_path`'s graph (for error messages)."""
    prompt = f" prompt_site={prompt_site}" if prompt_site else ""
    return f"python -m fedst.export run={run} site={site}{prompt} format={format}"
