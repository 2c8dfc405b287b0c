"""Finished runs as data: run directories found and loaded (config, metrics, communication,
final scores), grouped by method, summarised as mean ± std over seeds, and the table model the
reports and plots share (:class:`Table`, :class:`Stat`). The tables in the paper's layouts are
built from these by :mod:`fedst.report.tables`, the figures by :mod:`fedst.report.plots`.

Runs of one method (several seeds) are summarised as ``mean ± std``; the std is the sample
standard deviation (``ddof=1``, the usual choice for a few repeated seeds as in the paper's three);
a method with a single run shows only its value. Per-run averages over sites ("Avg.") are computed
first and then summarised over seeds, so the Avg. spread reflects seed-to-seed variation of the
average (as in Table II, where the Avg. std is smaller than the per-site ones).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from fedst.cli import learning_keys
from fedst.config import to_dict
from fedst.errors import UserError
from fedst.experiment import experiment_from_json
from fedst.runs.files import unfinished
from fedst.runs.layout import (
    COMM_JSONL,
    CONFIG_JSON,
    CONFIG_YAML,
    FINAL_JSON,
    METRICS_JSONL,
    TRAIN_JSONL,
)
from fedst.scoring.formatting import format_score
from fedst.storage import read_jsonl

log = logging.getLogger(__name__)

RUN_FILES: tuple[str, ...] = (CONFIG_YAML, METRICS_JSONL, COMM_JSONL, FINAL_JSON)
STD_DDOF = 1
METRIC_LABELS: dict[str, str] = {
    "dice": "Dice (%)",
    "iou": "IoU (%)",
    "hd95": "HD95 (px)",
    "assd": "ASSD (px)",
    "challenge_iou": "challenge IoU (%)",
    "isi_iou": "ISI IoU (%)",
    "mciou": "mcIoU (%)",
}
HIGHER_IS_BETTER: dict[str, bool] = {
    "dice": True,
    "iou": True,
    "hd95": False,
    "assd": False,
    "challenge_iou": True,
    "isi_iou": True,
    "mciou": True,
}
DIGITS = 2


class RunError(UserError, ValueError):
    """A run directory that cannot be read; the message names the directory and the file."""


# ---------------------------------------------------------------------------------------------
# Loading runs


HYDRA_DIR = ".hydra"
"""Hydra's folder in every job directory it starts (a run that stopped before writing any of
:data:`RUN_FILES` still has it)."""

SKIP_HINT = "pass --skip-incomplete to leave it out"
"""The fix named by every error about a folder that is not a finished run (fedst.report's flag)."""


def _is_run_dir(path: Path) -> bool:
    """A run directory, finished or not: it holds any of :data:`RUN_FILES` or Hydra's folder."""
    return any((path / name).is_file() for name in RUN_FILES) or (path / HYDRA_DIR).is_dir()


def _refuse_or_skip(problem: str, skip_incomplete: bool) -> None:
    """A folder that is not a finished run: a :class:`RunError` naming the fix, or (when
    ``skip_incomplete``) one warning line."""
    if not skip_incomplete:
        raise RunError(f"{problem}; {SKIP_HINT}")
    log.warning("skipping %s", problem)


def find_runs(paths: Iterable[str | Path], skip_incomplete: bool = False) -> list[Path]:
    """Run directories among ``paths`` and below them (Hydra multirun dirs), sorted, unique.

    A directory is a run when it holds any of :data:`RUN_FILES` or a Hydra ``.hydra`` folder (a
    job that stopped before writing a run file is a run that :func:`load_run` refuses as
    unfinished); Hydra's own ``.hydra`` folders are not runs. A path that is not a directory, or
    a directory with no run in or below it (e.g. a report's output folder), is a
    :class:`RunError` naming it, or skipped with a warning when ``skip_incomplete``.
    """
    found: set[Path] = set()
    for raw in paths:
        root = Path(raw)
        if not root.is_dir():
            problem = f"{root}: not a directory (pass run directories or multirun directories)"
            _refuse_or_skip(problem, skip_incomplete)
            continue
        if _is_run_dir(root):
            found.add(root)
            continue
        below = {
            f.parent
            for name in (*RUN_FILES, HYDRA_DIR)
            for f in root.rglob(name)
            if HYDRA_DIR not in f.parent.relative_to(root).parts
        }
        if not below:
            problem = (
                f"{root}: not a run directory and no run directory below it (none holds any of "
                f"{', '.join(RUN_FILES)} or a {HYDRA_DIR} folder)"
            )
            _refuse_or_skip(problem, skip_incomplete)
        found.update(below)
    return sorted(found)


def _read_jsonl(path: Path) -> list[dict]:
    """fedst.storage.read_jsonl (a last line cut short by a killed writer is skipped with a warning)."""
    try:
        return read_jsonl(path)
    except ValueError as err:
        raise RunError(str(err)) from err


def learning_values(run_dir: Path, config: object) -> dict[str, object]:
    """What a run learns: its config as flat keys (``{"train.lr": 3e-4, ...}``) without ``seed``
    and without the keys that only change where and when it computes
    (:func:`fedst.cli.learning_keys`, which :func:`fedst.cli.learning_differences` compares
    too). Two runs with equal values are seeds of one configuration.

    Read from config.json as today's typed config when it parses (a key added since the run
    started then holds its default, as the run had it), else from the saved ``config`` as is.
    """
    try:
        values = to_dict(experiment_from_json((run_dir / CONFIG_JSON).read_text()))
    except (OSError, ValueError):
        values = dict(config) if isinstance(config, Mapping) else {}
    return {key: value for key, value in learning_keys(values).items() if key != "seed"}


def load_run(path: str | Path) -> dict:
    """One run: {"path", "method", "seed", "experiment", "config", "learning", "final",
    "metrics", "comm", "train"} ("learning": :func:`learning_values`; "train": rows of
    train.jsonl, empty when the run has none).

    Raises :class:`RunError` naming the first missing or unreadable file, or why the run has
    not finished training (:func:`fedst.runs.files.unfinished`: also when an evaluation wrote its
    final.json before the end).
    """
    run_dir = Path(path)
    missing = [name for name in RUN_FILES if not (run_dir / name).is_file()]
    if len(missing) == len(RUN_FILES):
        raise RunError(
            f"{run_dir}: not a finished run, it holds none of {', '.join(RUN_FILES)} (a run "
            "that stopped before training: its log says why)"
        )
    if missing:
        raise RunError(
            f"{run_dir}: incomplete run, missing {missing[0]} (a run writes "
            f"{', '.join(RUN_FILES)}; final.json appears when training finishes)"
        )
    reason = unfinished(run_dir)
    if reason is not None:
        raise RunError(
            f"{run_dir}: not a finished run, {reason}; resume it (python train_fed.py "
            f"resume={run_dir})"
        )
    try:
        config = yaml.safe_load((run_dir / CONFIG_YAML).read_text()) or {}
    except yaml.YAMLError as err:
        raise RunError(f"{run_dir / CONFIG_YAML}: not valid YAML ({err})") from err
    try:
        final = json.loads((run_dir / FINAL_JSON).read_text())
    except json.JSONDecodeError as err:
        raise RunError(f"{run_dir / FINAL_JSON}: not valid JSON ({err.msg})") from err
    for key in ("method", "seed", "sites"):
        if key not in final:
            raise RunError(f"{run_dir / FINAL_JSON}: missing key {key!r}")
    return {
        "path": run_dir,
        "method": str(final["method"]),
        "seed": final["seed"],
        "experiment": final.get(
            "experiment", config.get("experiment") if isinstance(config, Mapping) else None
        ),
        "config": config,
        "learning": learning_values(run_dir, config),
        "final": final,
        "metrics": _read_jsonl(run_dir / METRICS_JSONL),
        "comm": _read_jsonl(run_dir / COMM_JSONL),
        "train": _read_jsonl(run_dir / TRAIN_JSONL) if (run_dir / TRAIN_JSONL).is_file() else [],
    }


def load_runs(paths: Iterable[str | Path], skip_incomplete: bool = False) -> list[dict]:
    """Load every run in ``paths`` (run or multirun directories, see :func:`find_runs`).

    A folder that is not a finished run (unfinished, unreadable, or no run at all) raises
    :class:`RunError`, or is skipped with one warning line when ``skip_incomplete``. Runs that
    share a seed in one table row (:func:`group_by_method`) are named in one warning.
    """
    paths = list(paths)
    runs = []
    for run_dir in find_runs(paths, skip_incomplete):
        try:
            runs.append(load_run(run_dir))
        except RunError as err:
            _refuse_or_skip(str(err), skip_incomplete)
    if not runs:
        raise RunError(
            f"no finished run in {', '.join(map(str, paths))} (every folder was skipped: see the "
            "warnings above); pass directories of runs whose final.json exists"
        )
    runs = without_copies(runs)
    for line in shared_seeds(group_by_method(runs)):
        log.warning("%s", line)
    return runs


def _identity(run: Mapping) -> tuple:
    """What makes two loaded runs one: method, seed, config (:func:`learning_values`) and the
    scores of its final.json (its sites and out-of-federation sites)."""
    final = run["final"]
    scores = json.dumps([final.get("sites"), final.get("out_of_federation")], sort_keys=True)
    learning = json.dumps(_learning(run), sort_keys=True, default=str)
    return run["method"], str(run["seed"]), learning, scores


def without_copies(runs: Sequence[dict]) -> list[dict]:
    """``runs`` with each copy of a run left out, in one warning line per copy: a run of the same
    method, seed and config with the same scores (a copied run folder, or the same run trained
    twice) is one data point, so a row counts it once. Runs sharing a seed whose scores differ
    stay (:func:`shared_seeds` names them)."""
    kept: dict[tuple, dict] = {}
    for run in runs:
        first = kept.setdefault(_identity(run), run)
        if first is not run:
            log.warning(
                "%s: a copy of %s (same method, seed, config and scores); counted once",
                run["path"],
                first["path"],
            )
    return list(kept.values())


def _experiment_label(experiment: object) -> str:
    if isinstance(experiment, Mapping):
        return str(experiment.get("name", experiment))
    return str(experiment)


def _learning(run: Mapping) -> dict[str, object]:
    """A loaded run's :func:`learning_values` (from its "config" for a run built by hand)."""
    if "learning" in run:
        return run["learning"]
    return learning_values(Path(run.get("path", "")), run.get("config"))


def _show(value: object) -> str:
    """A config value in a row label, as written in a config ("[A, B]", "null", "true")."""
    if isinstance(value, list | tuple):
        return "[" + ", ".join(map(_show, value)) + "]"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return str(value)


def group_by_method(runs: Sequence[dict]) -> dict[str, list[dict]]:
    """Runs pooled into table rows (label -> runs), in order of first appearance.

    A row pools only runs of one method whose configs differ in the seed alone
    (:func:`learning_values`): a reader comparing methods takes a row's mean ± std for one
    configuration's seed-to-seed spread. Runs of one method that differ in anything else (rounds,
    a held-out site, a learning rate) are split, not refused: each configuration gets its own
    row, labelled "method [key=value, ...]" with the keys that tell that method's rows apart, so
    ``python -m fedst.report runs/*`` over a folder of mixed runs still shows every run, none
    averaged with another configuration's, and the label says what differs. Keys that only
    change where and when a run computes (device, evaluation cadence, ...) never split a row.
    When the runs come from more than one experiment, the label is "method [experiment]".
    """
    experiments = {_experiment_label(r.get("experiment")) for r in runs}
    pools: dict[str, list[list[dict]]] = {}
    for run in runs:
        label = run["method"]
        if len(experiments) > 1:
            label = f"{label} [{_experiment_label(run.get('experiment'))}]"
        same = pools.setdefault(label, [])
        for pool in same:
            if _learning(pool[0]) == _learning(run):
                pool.append(run)
                break
        else:
            same.append([run])
    groups: dict[str, list[dict]] = {}
    for label, same in pools.items():
        if len(same) == 1:
            groups[label] = same[0]
            continue
        values = [_learning(pool[0]) for pool in same]
        keys = sorted({key for v in values for key in v})
        differing = [k for k in keys if any(v.get(k) != values[0].get(k) for v in values)]
        for pool, value in zip(same, values, strict=True):
            shown = ", ".join(f"{k}={_show(value.get(k))}" for k in differing)
            groups[f"{label} [{shown}]"] = pool
    return groups


def shared_seeds(groups: Mapping[str, Sequence[dict]]) -> list[str]:
    """One line per seed that several runs of one row share, naming the runs: they are all
    averaged, so a copied run counts twice."""
    lines = []
    for label, group in groups.items():
        paths: dict[str, list[str]] = {}
        for run in group:
            paths.setdefault(str(run["seed"]), []).append(str(run.get("path")))
        for seed, shared in paths.items():
            if len(shared) > 1:
                lines.append(
                    f"{label}: runs {', '.join(shared)} share seed {seed} and their config; all "
                    "are averaged into one row (leave out copies of a run)"
                )
    return lines


# ---------------------------------------------------------------------------------------------
# Tables


@dataclass(frozen=True)
class Stat:
    """Mean and sample std (``None`` for a single value) over ``n`` runs."""

    mean: float
    std: float | None
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stat | None:
        """Summary of the finite values; ``None`` when there is none."""
        finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        if not finite:
            return None
        std = float(np.std(finite, ddof=STD_DDOF)) if len(finite) > 1 else None
        return cls(float(np.mean(finite)), std, len(finite))

    def format(self, digits: int = DIGITS) -> str:
        """ "mean ± std" with ``digits`` decimals; just the mean for a single run. Each number
        is rounded once, from the unrounded value, by :func:`fedst.scoring.formatting.format_score` (the
        one rounding of every printed score)."""
        if self.std is None:
            return format_score(self.mean, digits)
        return f"{format_score(self.mean, digits)} ± {format_score(self.std, digits)}"

    def __str__(self) -> str:
        return self.format()


@dataclass(frozen=True)
class Column:
    """A numeric column: CSV key, markdown header, metric (for "best" marking), decimals."""

    key: str
    header: str
    metric: str | None = None
    digits: int = DIGITS


@dataclass
class Table:
    """Rows = methods; cells = :class:`Stat` over the method's runs that have the value, or
    ``None`` when none has it (shown as "n/a")."""

    name: str
    title: str
    columns: list[Column]
    rows: dict[str, list[Stat | None]] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    text_headers: list[str] = field(default_factory=list)
    """Descriptive columns between "Runs" and the numbers (e.g. Table IV's component marks)."""
    texts: dict[str, list[str]] = field(default_factory=dict)
    """Per row, one string per text header (missing rows: empty strings)."""
    notes: list[str] = field(default_factory=list)
    """Lines printed under the markdown table (units, device, rows not available and why)."""

    def arrange(self, order: Sequence[str]) -> Table:
        """The same table with rows in ``order``; a label without runs becomes a row of "n/a"
        with 0 runs (never dropped), and rows not in ``order`` are kept after them."""
        labels = [*order, *(label for label in self.rows if label not in order)]
        return dataclasses.replace(
            self,
            rows={k: self.rows.get(k, [None] * len(self.columns)) for k in labels},
            runs={k: self.runs.get(k, 0) for k in labels},
        )

    def _texts(self, method: str) -> list[str]:
        return self.texts.get(method, [""] * len(self.text_headers))

    def _best(self, index: int) -> float | None:
        metric = self.columns[index].metric
        means = [cells[index].mean for cells in self.rows.values() if cells[index] is not None]
        if metric is None or len(means) < 2:
            return None
        return max(means) if HIGHER_IS_BETTER[metric] else min(means)

    def to_markdown(self) -> str:
        """A GitHub markdown table; the best mean of each metric column is bold."""
        best = [self._best(i) for i in range(len(self.columns))]
        headers = [*self.text_headers, *(c.header for c in self.columns)]
        lines = [
            f"### {self.title}",
            "",
            "| Method | Runs | " + " | ".join(headers) + " |",
            "|---|---:|" + ":-:|" * len(self.text_headers) + "---:|" * len(self.columns),
        ]
        for method, cells in self.rows.items():
            texts = []
            for cell, best_mean, column in zip(cells, best, self.columns, strict=True):
                if cell is None:
                    texts.append("n/a")
                elif best_mean is not None and cell.mean == best_mean:
                    texts.append(f"**{cell.format(column.digits)}**")
                else:
                    texts.append(cell.format(column.digits))
            texts = [*self._texts(method), *texts]
            lines.append(f"| {method} | {self.runs[method]} | " + " | ".join(texts) + " |")
        if self.notes:
            lines += ["", *self.notes]
        return "\n".join(lines) + "\n"

    def to_csv(self, path: str | Path) -> Path:
        """Columns: method, runs, then ``<key>_mean`` and ``<key>_std`` per column."""
        path = Path(path)
        header = ["method", "runs", *self.text_headers]
        for column in self.columns:
            header += [f"{column.key}_mean", f"{column.key}_std"]
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            for method, cells in self.rows.items():
                row: list[object] = [method, self.runs[method], *self._texts(method)]
                for cell in cells:
                    row += (
                        ["", ""]
                        if cell is None
                        else [cell.mean, "" if cell.std is None else cell.std]
                    )
                writer.writerow(row)
        return path


def metric_value(scores: Mapping | None, metric: str) -> float | None:
    if not isinstance(scores, Mapping):
        return None
    value = scores.get(metric)
    return None if value is None else float(value)


def site_value(run: dict, section: str, site: str, metric: str) -> float | None:
    """One run's final ``metric`` of ``site`` in ``section``; ``None`` when absent."""
    return metric_value(run["final"].get(section, {}).get(site), metric)


def run_average(run: dict, sites: Sequence[str], metric: str) -> float | None:
    """Mean over ``sites`` of one run; ``None`` if any site is missing in that run."""
    values = [site_value(run, "sites", s, metric) for s in sites]
    if not values or any(v is None for v in values):
        return None
    return float(np.mean(values))


def site_names(runs: Sequence[dict], section: str) -> list[str]:
    """Site names in ``section`` ("sites" or "out_of_federation") of all runs, first seen first."""
    names: dict[str, None] = {}
    for run in runs:
        names.update(dict.fromkeys(sorted(run["final"].get(section) or {})))
    return list(names)


def build_table(
    name: str,
    title: str,
    runs: Sequence[dict],
    columns: list[Column],
    cell_values: Sequence,
) -> Table:
    """A table whose cell j of a method's row is Stat.of(cell_values[j](run) for its runs)."""
    table = Table(name=name, title=title, columns=columns)
    for method, group in group_by_method(runs).items():
        table.rows[method] = [Stat.of(value(run) for run in group) for value in cell_values]
        table.runs[method] = len(group)
    return table


AVERAGE_PANEL = "Average"
"""The learning curves' first panel: per run and round, the mean over its sites (Fig. 5 "Avg.")."""


def _curve_rows(rows: Sequence[Mapping], model: str | None) -> list[Mapping]:
    """Test rows of one model kind; by default "personal", else "global" (never "outfed")."""
    rows = [r for r in rows if r.get("split", "test") == "test"]
    if model is None:
        kinds = {r.get("model") for r in rows}
        model = "personal" if "personal" in kinds else "global"
    return [r for r in rows if r.get("model", model) == model]


def curve_values(
    metrics_rows: Sequence[Mapping], metric: str = "dice", model: str | None = None
) -> dict[str, dict[int, list[float]]]:
    """{"Average" | site: {round: [value of each seed]}} from metrics.jsonl rows of one method
    (several seeds told apart by a "seed" key): the test ``metric`` of every evaluated round
    (paper Fig. 5). The average panel first averages a seed's sites in a round (only rounds where
    all of the method's sites reported), then lists that mean per seed. ``model``: "personal" /
    "global"; default: personal rows where present, else global."""
    rows = [r for r in _curve_rows(metrics_rows, model) if r.get(metric) is not None]
    sites = sorted({str(r["site"]) for r in rows})
    per_site: dict[str, dict[int, list[float]]] = {s: {} for s in sites}
    per_seed: dict[tuple[object, int], dict[str, float]] = {}
    for row in rows:
        site, rnd, value = str(row["site"]), int(row["round"]), float(row[metric])
        per_site[site].setdefault(rnd, []).append(value)
        per_seed.setdefault((row.get("seed"), rnd), {})[site] = value
    average: dict[int, list[float]] = {}
    for (_, rnd), site_values in per_seed.items():
        if len(site_values) == len(sites):
            average.setdefault(rnd, []).append(float(np.mean(list(site_values.values()))))
    return {AVERAGE_PANEL: average, **per_site}
