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
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import torch

from fedst.federation.run_io import atomic_torch_save, load_checkpoint, remove_stale_tmp

FEATURE_BANK_DIR = "checkpoints/feature_bank"
"""The bank's folder in the run directory (beside ``checkpoints/server.pt``)."""
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

    def read(self, server_round: int) -> dict[str, torch.Tensor]:
        """The bank of ``server_round``: per sample its newest entry of a round <= it. Files of
        later rounds (written before a crash, their ``server.pt`` never) are deleted."""
        remove_stale_tmp(self.folder)
        bank = {}
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
