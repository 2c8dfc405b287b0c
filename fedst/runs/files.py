"""A run's JSON-lines logs, mirrored to TensorBoard, and its config read back. What each file
holds: fedst/runs/layout.py; atomic writes: fedst/storage.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedst.experiment import ExperimentConfig, experiment_from_json
from fedst.runs.layout import CONFIG_JSON, FINAL_JSON
from fedst.storage import atomic_write_text, disk_write_error, read_jsonl


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
        try:
            with path.open("a") as handle:
                handle.write(json.dumps(row, sort_keys=True) + "\n")
        except OSError as err:
            raise disk_write_error(err, path) from err
        if self._writer is not None and "round" in row:
            tag = "/".join(str(row[k]) for k in ("site", "model") if k in row)
            if row.get("split", "test") != "test":  # validation scores: their own curves
                tag += f"/{row['split']}"
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


def load_config(run_dir: Path) -> ExperimentConfig:
    """The experiment of the run in ``run_dir`` (its config.json, written when the run started)."""
    path = run_dir / CONFIG_JSON
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: is {run_dir} a FedST run directory?")
    return experiment_from_json(path.read_text())


def unfinished(run_dir: Path) -> str | None:
    """Why the run in ``run_dir`` has not finished training, or None when it has.

    Only the end of training writes final.json (fedst/runs/final.py ``write_final``), with the
    rounds it trained (``rounds``). A run is unfinished without final.json, or when its final.json
    scores fewer rounds than its config's ``train.rounds``: an evaluation of an interrupted run
    wrote it (eval_outfed.py did before issue 46). A final.json or config.json that does not say
    how many rounds (a run older than both keys) cannot be told apart and counts as finished.
    """
    final_path = run_dir / FINAL_JSON
    if not final_path.is_file():
        return "no final.json"
    try:
        trained = json.loads(final_path.read_text()).get("rounds")
        planned = json.loads((run_dir / CONFIG_JSON).read_text())["train"]["rounds"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable: the reader of the file reports it
    if isinstance(trained, int) and isinstance(planned, int) and trained < planned:
        return (
            f"it trained {trained} of {planned} rounds (its final.json was written by an "
            "evaluation before its training ended)"
        )
    return None
