"""The driver of a prepared check (bench/gpu_check/check.py): a :class:`Step`'s commands run in order,
each in its own process group within the step's time limit (killed with its children when it
runs over), nvidia-smi's utilisation and memory sampled meanwhile (:class:`GpuWatch`), and its
outputs collected into a :class:`StepResult`, partial where it failed or timed out."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[2]


class CheckFailed(RuntimeError):
    """A step ran but what it produced does not show what it should."""


@dataclass
class Step:
    """One step of the check: commands run in order (each must exit 0), then ``collect`` reads
    their outputs into the report's metrics (or raises :class:`CheckFailed`)."""

    name: str
    title: str
    timeout_s: float
    commands: list[list[str] | Callable[[], list[str]]]
    """argv lists, or functions that make one when its turn comes (from an earlier one's files)"""
    collect: Callable[[], dict] = dict
    env: dict[str, str] = field(default_factory=dict)
    unsupported: str | None = None
    """Why the step cannot run in this checkout (a config field it overrides is missing)."""
    measures: str = ""
    """What the step's figures measure and over what window (the report prints it)."""


@dataclass
class StepResult:
    name: str
    title: str
    status: str
    """ok | failed | timeout | unsupported | not run"""
    seconds: float = 0.0
    commands: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    note: str = ""
    gpu: dict = field(default_factory=dict)
    measures: str = ""


class GpuWatch:
    """nvidia-smi's utilisation and memory used every 100 ms during one step (no-op without it)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.samples: list[tuple[float, float]] = []
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            parts = [p.strip() for p in line.split(",")]
            with contextlib.suppress(ValueError):
                self.samples.append((float(parts[0]), float(parts[1])))

    def __enter__(self) -> GpuWatch:
        if self.enabled:
            self._process = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=utilization.gpu,memory.used",
                    "--format=csv,noheader,nounits",
                    "-lms=100",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            assert self._thread is not None
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        return {
            "utilization_mean_pct": mean(u for u, _ in self.samples),
            "memory_used_max_mib": max(m for _, m in self.samples),
            "samples": len(self.samples),
        }


def _run_command(command: list[str], env: dict[str, str], timeout_s: float, logfile) -> int:
    """Run ``command`` in its own process group, output appended to ``logfile``; on timeout the
    whole group (loader workers included) is killed and -1 returned."""
    logfile.write(f"\n$ {' '.join(command)}\n")
    logfile.flush()
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        return process.wait(timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        logfile.write(f"\n[gpu_check] killed after {timeout_s:.0f} s\n")
        return -1


def run_step(step: Step, env: dict[str, str], timeout_s: float, gpu: bool, logfile) -> StepResult:
    """Run one step within ``timeout_s`` and collect its result (partial metrics even after a
    timeout or a failed command, where its files exist)."""
    result = StepResult(step.name, step.title, "ok", measures=step.measures)
    if step.unsupported:
        result.status, result.note = "unsupported", step.unsupported
        return result
    if timeout_s < 5:
        result.status, result.note = "not run", "the overall budget is spent"
        return result
    started = time.monotonic()
    with GpuWatch(gpu) as watch:
        for planned in step.commands:
            try:
                command = planned() if callable(planned) else planned
            except (OSError, IndexError) as err:
                result.status, result.note = "failed", f"cannot build a command: {err}"
                break
            result.commands.append(" ".join(command))
            left = timeout_s - (time.monotonic() - started)
            code = _run_command(command, {**env, **step.env}, left, logfile)
            if code != 0:
                result.status = "timeout" if code == -1 else "failed"
                result.note = f"`{' '.join(command[:4])} ...` " + (
                    f"was stopped at the step's {timeout_s:.0f} s"
                    if code == -1
                    else f"exited {code} (gpu_check.log)"
                )
                break
    result.seconds = time.monotonic() - started
    result.gpu = watch.summary()
    try:
        result.metrics = step.collect()
    except CheckFailed as err:
        if result.status == "ok":
            result.status, result.note = "failed", str(err)
    except (OSError, KeyError, ValueError, TypeError) as err:
        if result.status == "ok":
            result.status = "failed"
            result.note = f"its output is missing or malformed: {type(err).__name__}: {err}"
    return result
