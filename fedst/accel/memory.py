"""This process's memory for the run log: per-phase peaks (:class:`PhasePeaks`), the figures
now (:func:`memory_usage`), and giving the heap's free pages back (:func:`release_free_memory`)."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Iterator

import torch

_HIGHEST_RSS_MARK = 0
"""The highest resident high-water mark (VmHWM) this process has read, at a phase's marks or
before a :class:`PhasePeaks` reset. The whole-run peak is kept here: a reset lowers the kernel's
mark and ``ru_maxrss``, and the kernel folds the resident size into its mark lazily, so a later
reading can be below an earlier one."""

_CUDA_PEAKS_BEFORE_RESETS = [0, 0]
"""The current CUDA device's peak allocated and reserved bytes as they stood at the latest
:class:`PhasePeaks` reset (``torch.cuda.reset_peak_memory_stats`` forgets them)."""


class _PhaseMarks:
    """The high-water marks of one phase in progress: resident bytes (None: not measured) and
    the CUDA device's peak allocated / reserved bytes (None: CUDA not in use)."""

    def __init__(self, rss: bool) -> None:
        self.rss: int | None = 0 if rss else None
        self.cuda: list[int] | None = None

    def credit(self, rss: int | None, cuda: tuple[int, int] | None) -> None:
        if self.rss is not None and rss is not None:
            self.rss = max(self.rss, rss)
        if cuda is not None:
            self.cuda = [max(a, b) for a, b in zip(self.cuda or (0, 0), cuda, strict=True)]


_OPEN_PHASES: list[_PhaseMarks] = []
"""Phases in progress in this process, outermost first. A phase nested in another (in the
in-process engine a site's round runs inside the server's "train" phase) resets the marks; the
marks are credited to every open phase first, so the outer phase's figure still covers it."""


def _cuda_peaks() -> tuple[int, int] | None:
    """(peak allocated, peak reserved) bytes of the current CUDA device since its last reset;
    None where this process has not initialised CUDA (a CPU run: no figure, never zero)."""
    if not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _credit_open_phases() -> tuple[int | None, tuple[int, int] | None]:
    """Credit the current marks to every open phase and to the whole-run marks; returns them."""
    global _HIGHEST_RSS_MARK
    rss, cuda = _kernel_peak_rss(), _cuda_peaks()
    for marks in _OPEN_PHASES:
        marks.credit(rss, cuda)
    if rss is not None:
        _HIGHEST_RSS_MARK = max(_HIGHEST_RSS_MARK, rss)
    if cuda is not None:
        _CUDA_PEAKS_BEFORE_RESETS[:] = [
            max(a, b) for a, b in zip(_CUDA_PEAKS_BEFORE_RESETS, cuda, strict=True)
        ]
    return rss, cuda


def _kernel_peak_rss() -> int | None:
    """VmHWM of /proc/self/status in bytes (the resident high-water mark), None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_kernel_peak_rss() -> bool:
    """Lower the kernel's high-water mark to the resident size now (``echo 5 >
    /proc/self/clear_refs``, Linux >= 4.0), keeping the old mark in :data:`_HIGHEST_RSS_MARK`.
    False when the kernel does not allow it."""
    global _HIGHEST_RSS_MARK
    before = _kernel_peak_rss()
    if before is None:
        return False
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    _HIGHEST_RSS_MARK = max(_HIGHEST_RSS_MARK, before)
    return True


REPLY_MEMORY_KEYS = {
    "cuda-peak-allocated-bytes": "cuda_peak_allocated_bytes",
    "cuda-peak-reserved-bytes": "cuda_peak_reserved_bytes",
}
"""A site's GPU memory in its train reply (:meth:`PhasePeaks.reply_metrics`) -> its train.jsonl
field. Absent from a reply (and the row) where the site computes on the CPU."""


class PhasePeaks:
    """The peak memory of each phase of a round, for the run log:
    ``with peaks.phase("train"): ...`` then ``peaks.row()`` ->
    ``{"train_peak_rss_bytes": ..., "train_cuda_peak_allocated_bytes": ...,
    "train_cuda_peak_reserved_bytes": ...}``.

    Resident memory (``rss``): each phase lowers the kernel's high-water mark to the resident
    size at its start and reads it at its end, so a phase's figure is the most this process held
    during that phase (in the in-process engine the sites live in this process too: the whole
    job's). Off Linux, or where the kernel refuses the reset, there is no such figure rather than
    a wrong one. GPU memory: the current CUDA device's peak allocated (tensors) and reserved
    (PyTorch's caching allocator: what the device lends the process) bytes, reset at each phase's
    start (``torch.cuda.reset_peak_memory_stats``); absent where the process has not initialised
    CUDA. Phases may nest (in-process, a site's round inside the server's "train")."""

    def __init__(self, rss: bool = True) -> None:
        self.rss = rss
        self.peaks: dict[str, int] = {}
        self.cuda: dict[str, tuple[int, int]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        _credit_open_phases()  # before the resets: the enclosing phases keep what they saw
        measured = self.rss and _reset_kernel_peak_rss()
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        marks = _PhaseMarks(rss=measured)
        _OPEN_PHASES.append(marks)
        try:
            yield
        finally:
            _credit_open_phases()
            _OPEN_PHASES.remove(marks)
            if marks.rss is not None:
                self.peaks[name] = max(self.peaks.get(name, 0), marks.rss)
            if marks.cuda is not None:
                allocated, reserved = self.cuda.get(name, (0, 0))
                self.cuda[name] = (max(allocated, marks.cuda[0]), max(reserved, marks.cuda[1]))

    def row(self) -> dict[str, int]:
        """Every phase's figures as run-log fields (a phase without one has no field)."""
        row = {f"{name}_peak_rss_bytes": peak for name, peak in self.peaks.items()}
        for name, (allocated, reserved) in self.cuda.items():
            row[f"{name}_cuda_peak_allocated_bytes"] = allocated
            row[f"{name}_cuda_peak_reserved_bytes"] = reserved
        return row

    def reply_metrics(self, name: str) -> dict[str, int]:
        """Phase ``name``'s GPU peaks as a site's reply metrics (:data:`REPLY_MEMORY_KEYS`);
        empty without CUDA."""
        if name not in self.cuda:
            return {}
        return dict(zip(REPLY_MEMORY_KEYS, self.cuda[name], strict=True))


def _resident_bytes() -> int | None:
    """This process's resident size now (/proc/self/statm; None off Linux)."""
    try:  # /proc/self/statm: pages of [size, resident, ...]
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_usage() -> dict[str, int]:
    """This process's memory for the run log: ``rss_bytes`` (resident now, Linux only),
    ``peak_rss_bytes`` (the most it has held so far) and, where it has initialised CUDA, the
    current device's ``cuda_allocated_bytes`` / ``cuda_reserved_bytes`` (now) and
    ``cuda_peak_bytes`` / ``cuda_peak_reserved_bytes`` (the most allocated to tensors / reserved
    by the caching allocator so far); the CUDA fields are absent on a CPU run, never zero. In the
    in-process engine the sites live in this process too, so these are the whole job's figures."""
    usage: dict[str, int] = {}
    resident = _resident_bytes()
    if resident is not None:
        usage["rss_bytes"] = resident
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak = peak if sys.platform == "darwin" else peak * 1024
    _, cuda = _credit_open_phases()  # also folds the kernel's mark now into _HIGHEST_RSS_MARK
    # never below a phase's peak (every phase reading is in _HIGHEST_RSS_MARK); ru_maxrss and
    # the kernel's mark are updated lazily and can lag the resident size just read
    usage["peak_rss_bytes"] = max(peak, _HIGHEST_RSS_MARK, usage.get("rss_bytes", 0))
    if cuda is not None:
        usage["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        usage["cuda_reserved_bytes"] = torch.cuda.memory_reserved()
        usage["cuda_peak_bytes"], usage["cuda_peak_reserved_bytes"] = _CUDA_PEAKS_BEFORE_RESETS
    return usage


_LIBC_MALLOC_TRIM = None
"""glibc's ``malloc_trim`` (None until first looked up; False where there is none)."""


def release_free_memory() -> int | None:
    """Give the heap's free pages back to the operating system (glibc ``malloc_trim(0)``);
    returns how many bytes of resident memory that released, or None where it cannot be done
    (not glibc, or no /proc/self/statm).

    Why: a training step at 512x640 (PVTv2-b0, 2 clips x 4 frames) allocates and frees about 3 GB
    of activations on the CPU. glibc keeps most of those freed pages in its heap, since tensors
    above its (dynamic, up to 32 MB) mmap threshold are not unmapped when freed. So the process
    stays at about 2.5 GB between steps where 0.9 GB is live. In the in-process engine four
    sites, the SERQ step and evaluation leave their arenas behind one after another. Called
    where a site's work for a message ends and after the server step (fedst/app), it changes no
    result, only the resident memory between phases (docs/paper-scale.md)."""
    global _LIBC_MALLOC_TRIM
    if _LIBC_MALLOC_TRIM is None:
        _LIBC_MALLOC_TRIM = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                _LIBC_MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):  # musl and others: no malloc_trim
                pass
    before = _resident_bytes()
    if not _LIBC_MALLOC_TRIM or before is None:
        return None
    _LIBC_MALLOC_TRIM(0)
    return max(0, before - (_resident_bytes() or before))
