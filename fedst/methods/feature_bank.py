"""SERQ's feature bank on disk, beside the server checkpoint: one file per entry version.

The bank F_hat_g (Eq. 10) holds one float16 [c, h, w] tensor per synthetic sample (640 KiB at
512x640; 2.3 GB for SISVSE's 3600 images), but a round changes only ``batches_per_round x
batch_size`` entries. So the bank is not in ``server.pt``: each save writes only the entries
changed since the previous save, each to its own file

    checkpoints/feature_bank/<sample id, %-quoted>.r<round, 6 digits>.pt

named by the round of the checkpoint it belongs to (written atomically, temporary file then
rename). The bank of round R is, per sample, its newest file of a round <= R. Consistency with
``server.pt`` (design note):

* Entries are written *before* ``server.pt``; a crash in between leaves files of round R + 1
  while ``server.pt`` is of round R. Loading round R ignores and deletes every file newer than R
  (the round is re-run and writes them again), so the bank is exactly that of round R.
* ``server.prev.pt`` (round P, the fallback) must stay loadable: after ``server.pt`` of round R
  is written, :meth:`FeatureBankStore.prune` deletes a file only when a newer file of the same
  sample has a round <= P (it is then needed by neither round P nor round R), and every file
  newer than R.

Why one file per entry (rather than shards or an append-only log): a round's write is exactly its
changed entries, with no compaction pass (a log rewrites the whole bank when compacting), and
pruning is exact: the disk holds the bank plus at most one older version of the entries changed
since round P, whereas a shard of mixed entries can only go once all of them are superseded.
The cost is one small file per synthetic sample (3600 for SISVSE), well within any file system.

The working bank (``serq.bank_storage``). Between checkpoints SERQ reads and updates the bank in
a mapping: a dict in memory (``memory``), or a :class:`DiskFeatureBank` (``disk``), whose entries
live in one scratch file of fixed-size slots (``serq_bank.work`` in the run directory) and are
read and written one batch at a time (:func:`read_entries` / :func:`write_entries`: one buffer
per batch, one system call per run of consecutive slots), with only the id -> slot index in
memory. It takes the
bank's size (2.35 GB for SISVSE at 512x640) out of the server's resident memory for a 2 x 640 KiB
read and a 640 KiB write per sample visit (the operating system's page cache keeps recent slots,
and can drop them under memory pressure, unlike a process's heap). The scratch file is not a
checkpoint: a resumed run refills it from the entry files above.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import torch

from fedst.schema.feature_bank import FEATURE_BANK_DIR as FEATURE_BANK_DIR
from fedst.schema.feature_bank import SERQ_BANK_SCRATCH as SERQ_BANK_SCRATCH
from fedst.storage import atomic_torch_save, load_checkpoint, remove_stale_tmp

_ENTRY = re.compile(r"^(?P<id>.+)\.r(?P<round>\d{6})\.pt$")


@dataclass
class BankWrite:
    """What one :meth:`FeatureBankStore.write` put on disk."""

    files: int
    bytes: int


class FeatureBankStore:
    """The versioned entry files of one run's feature bank (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def entry_path(self, sample_id: str, server_round: int) -> Path:
        """The file of ``sample_id``'s entry written at ``server_round``."""
        return self.folder / f"{quote(sample_id, safe='')}.r{server_round:06d}.pt"

    def versions(self) -> dict[str, list[tuple[int, Path]]]:
        """Per sample id, its entry files as (round, path), oldest first."""
        found: dict[str, list[tuple[int, Path]]] = {}
        if not self.folder.is_dir():
            return found
        for path in self.folder.iterdir():
            match = _ENTRY.match(path.name)
            if match:
                found.setdefault(unquote(match["id"]), []).append((int(match["round"]), path))
        return {sample_id: sorted(files) for sample_id, files in found.items()}

    def write(
        self, bank: dict[str, torch.Tensor], sample_ids: Iterable[str], server_round: int
    ) -> BankWrite:
        """Write the entries ``sample_ids`` of ``bank`` (each [c, h, w] float16) as of
        ``server_round``, each atomically; call before the server checkpoint of that round."""
        files = size = 0
        for sample_id in sorted(set(sample_ids)):
            path = self.entry_path(sample_id, server_round)
            atomic_torch_save(bank[sample_id].detach().cpu().clone(), path)
            files, size = files + 1, size + path.stat().st_size
        return BankWrite(files, size)

    def read(
        self, server_round: int, into: MutableMapping[str, torch.Tensor] | None = None
    ) -> MutableMapping[str, torch.Tensor]:
        """The bank of ``server_round``: per sample its newest entry of a round <= it, filled
        one entry at a time into ``into`` (emptied first; None: a new dict). Files of later
        rounds (written before a crash, their ``server.pt`` never) are deleted."""
        remove_stale_tmp(self.folder)
        bank: MutableMapping[str, torch.Tensor] = {} if into is None else into
        bank.clear()
        for sample_id, files in self.versions().items():
            for file_round, path in files:
                if file_round > server_round:
                    path.unlink()
            current = [path for file_round, path in files if file_round <= server_round]
            if current:
                bank[sample_id] = load_checkpoint(current[-1])
        return bank

    def prune(self, server_round: int, previous_round: int | None) -> int:
        """After the checkpoint of ``server_round`` is written, with ``server.prev.pt`` of
        ``previous_round`` (None: no older checkpoint to keep loadable), delete every file that
        neither round's bank reads. Returns the number of files deleted."""
        keep_round = server_round if previous_round is None else previous_round
        deleted = 0
        for files in self.versions().values():
            older = [path for file_round, path in files if file_round <= keep_round]
            stale = older[:-1] + [path for file_round, path in files if file_round > server_round]
            for path in stale:
                path.unlink()
            deleted += len(stale)
        return deleted

    def clear(self) -> None:
        """Delete every entry file (a run that starts its bank afresh)."""
        for files in self.versions().values():
            for _, path in files:
                path.unlink()


class DiskFeatureBank(MutableMapping[str, torch.Tensor]):
    """SERQ's working bank in one scratch file (``serq.bank_storage=disk``; module docstring).

    A mapping sample id -> entry [c, h, w] like the in-memory dict it replaces: ``bank[id]``
    reads the entry's slot into a new tensor, ``bank[id] = entry`` writes it (a new id gets the
    next slot; an id keeps its slot). Every entry must have the first entry's shape and dtype.
    The file is created empty (truncated) and deleted by :meth:`close`.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._slots: dict[str, int] = {}
        self._shape: torch.Size | None = None
        self._dtype: torch.dtype | None = None
        self._slot_bytes = 0

    def _file(self) -> int:
        if self._fd is None:
            raise ValueError(f"DiskFeatureBank {self.path} is closed")
        return self._fd

    def _check_entry(self, sample_id: str, shape: torch.Size, dtype: torch.dtype) -> None:
        """Take the first entry's shape and dtype; refuse any other afterwards."""
        if self._shape is None:
            self._shape, self._dtype = shape, dtype
            self._slot_bytes = shape.numel() * dtype.itemsize
        elif (shape, dtype) != (self._shape, self._dtype):
            raise ValueError(
                f"feature bank entry {sample_id!r} is {tuple(shape)} {dtype}; the "
                f"bank holds {tuple(self._shape)} {self._dtype} entries"
            )

    def __setitem__(self, sample_id: str, entry: torch.Tensor) -> None:
        self.write_many([sample_id], entry[None])

    def __getitem__(self, sample_id: str) -> torch.Tensor:
        return self.read_many([sample_id])[0]

    def write_many(self, sample_ids: Sequence[str], entries: torch.Tensor) -> None:
        """``bank[sample_ids[i]] = entries[i]`` for a batch ``entries`` [N, *entry shape] at once:
        one host copy, one write per run of consecutive slots. An id given twice keeps its
        last entry."""
        if len(sample_ids) != len(entries):
            raise ValueError(f"write_many: {len(sample_ids)} sample ids for {len(entries)} entries")
        if not sample_ids:
            return
        for sample_id in sample_ids:
            self._check_entry(sample_id, entries.shape[1:], entries.dtype)
        host = entries.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        data, size = memoryview(host), self._slot_bytes
        slots = [self._slots.setdefault(sample_id, len(self._slots)) for sample_id in sample_ids]
        for first, count, slot in _runs(slots):
            chunk = data[first * size : (first + count) * size]
            written = os.pwrite(self._file(), chunk, slot * size)
            if written != len(chunk):
                raise OSError(f"short write to {self.path}: {written} of {len(chunk)} bytes")

    def read_many(self, sample_ids: Sequence[str], out: torch.Tensor | None = None) -> torch.Tensor:
        """The entries of ``sample_ids`` as one tensor [N, *entry shape], read into ``out``
        (e.g. pinned memory for a copy to the GPU without a host wait; None: a new tensor),
        one read per run of consecutive slots. KeyError for an id never written, as a dict."""
        slots = [self._slots[sample_id] for sample_id in sample_ids]
        if self._shape is None:  # only an empty batch reads an empty bank
            return torch.empty(0) if out is None else out
        shape = (len(slots), *self._shape)
        if out is None:
            out = torch.empty(shape, dtype=self._dtype)
        elif tuple(out.shape) != shape or out.dtype != self._dtype or not out.is_contiguous():
            raise ValueError(
                f"read_many: out is {tuple(out.shape)} {out.dtype}, needs a contiguous {shape} "
                f"{self._dtype} CPU tensor"
            )
        data, size = memoryview(out.view(-1).view(torch.uint8).numpy()), self._slot_bytes
        for first, count, slot in _runs(slots):
            chunk = data[first * size : (first + count) * size]
            read = os.preadv(self._file(), [chunk], slot * size)
            if read != len(chunk):
                raise OSError(f"short read from {self.path}: {read} of {len(chunk)} bytes")
        return out

    def __delitem__(self, sample_id: str) -> None:
        raise TypeError("SERQ's feature bank never drops a single entry; use clear()")

    def clear(self) -> None:
        """Forget every entry (the file is truncated)."""
        os.ftruncate(self._file(), 0)
        self._slots.clear()
        self._shape = self._dtype = None

    def __iter__(self) -> Iterator[str]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._slots

    def close(self) -> None:
        """Close and delete the scratch file (the bank's checkpoints are the entry files)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Runs of consecutive slots in ``slots``: (first position, length, first slot)."""
    start = 0
    for position in range(1, len(slots) + 1):
        if position == len(slots) or slots[position] != slots[position - 1] + 1:
            yield start, position - start, slots[start]
            start = position


def read_entries(
    bank: MutableMapping[str, torch.Tensor],
    sample_ids: Sequence[str],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The entries of ``sample_ids`` in SERQ's working bank (a dict or a
    :class:`DiskFeatureBank`) as one tensor [N, c, h, w], into ``out`` when given (e.g. pinned
    memory); every id must be in the bank (KeyError otherwise)."""
    if isinstance(bank, DiskFeatureBank):
        return bank.read_many(sample_ids, out)
    return torch.stack([bank[sample_id] for sample_id in sample_ids], out=out)


def write_entries(
    bank: MutableMapping[str, torch.Tensor], sample_ids: Sequence[str], entries: torch.Tensor
) -> None:
    """``bank[sample_ids[i]] = entries[i]`` for a batch ``entries`` [N, c, h, w] on the CPU
    (a dict keeps a copy of each row, not a view of the batch)."""
    if isinstance(bank, DiskFeatureBank):
        bank.write_many(sample_ids, entries)
        return
    for sample_id, entry in zip(sample_ids, entries, strict=True):
        bank[sample_id] = entry.clone()
