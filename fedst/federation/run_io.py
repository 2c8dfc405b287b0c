"""Run-directory I/O: atomic checkpoints, JSON-lines logs and TensorBoard scalars.

Layout of a run directory (every file is written by the server process unless noted):
```
config.json / config.yaml   resolved experiment config (config.yaml also holds Hydra's view)
metrics.jsonl               per-round evaluation rows (site, model, dice, iou, hd95, assd, per_class)
train.jsonl                 per-round training rows (site, loss, seconds, iterations)
comm.jsonl                  parameter bytes uploaded / downloaded per site per round
participation.jsonl         per round: the sites whose training replies were aggregated, and the missing
wire.jsonl                  (deploy.audit) record names, keys and shapes of every message
personal_export.json        (deployment) sites that sent rho_k at the end / declined / were unreachable
checkpoints/server.pt       last completed round: global model, SERQ state, RNG (atomic)
sites/<site>/state_rNNNN.pt a site's private state after round N (in-process: written by the site;
                            deployment: only rho_k of sites that sent it at the end)
final.json, tables/, plots/ written at the end
tensorboard/                scalars of all of the above
```
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_torch_save(obj: Any, path: Path) -> None:
    """Write ``obj`` with torch.save to a temporary file, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(text: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunLog:
    """Appends rows to ``<run>/<stream>.jsonl`` and mirrors numeric fields to TensorBoard.

    On resume, rows of rounds after the last checkpointed round are dropped first
    (:meth:`truncate_after`), so an interrupted round is not logged twice.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.run_dir = run_dir
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, stream: str, row: dict[str, Any]) -> None:
        path = self.run_dir / f"{stream}.jsonl"
        with path.open("a") as handle:
            handle.write(json.dumps(row, sort_keys=True) + "\n")
        if self._writer is not None and "round" in row:
            tag = "/".join(str(row[k]) for k in ("site", "model") if k in row)
            for key, value in row.items():
                if (
                    key != "round"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self._writer.add_scalar(f"{stream}/{key}/{tag}", value, row["round"])

    def truncate_after(self, last_round: int) -> None:
        for path in self.run_dir.glob("*.jsonl"):
            rows = [r for r in read_jsonl(path) if r.get("round", 0) <= last_round]
            atomic_write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), path)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
