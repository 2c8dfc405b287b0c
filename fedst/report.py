"""Result tables from run directories, in the layouts of the paper's Tables II, III/VIII and IX.

A run directory (written by ``train_fed.py``) holds ``config.yaml``, ``metrics.jsonl``,
``comm.jsonl`` and ``final.json`` (see :data:`RUN_FILES`). Runs of one method (several seeds) are
summarised as ``mean ± std``; the std is the sample standard deviation (``ddof=1``, the usual
choice for a few repeated seeds as in the paper's three); a method with a single run shows only
its value. Per-run averages over sites ("Avg.") are computed first and then summarised over seeds,
so the Avg. spread reflects seed-to-seed variation of the average (as in Table II, where the Avg.
std is smaller than the per-site ones).

CLI::

    python -m fedst.report RUN_DIR [RUN_DIR ...] [--out DIR] [--skip-incomplete] [--no-plots]
    python -m fedst.report msf RUN_DIR [RUN_DIR ...] [--out DIR]
    python -m fedst.report matrix RUN_DIR [--out DIR]

``msf`` and ``matrix``: fedst/report_selection.py.

A RUN_DIR may also be a Hydra multirun directory: every run directory below it is used.
"""

from __future__ import annotations

import argparse
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

from fedst import units
from fedst.federation.run_io import read_jsonl

__all__ = [
    "AVERAGE_PANEL",
    "METRIC_LABELS",
    "RUN_FILES",
    "RunError",
    "Stat",
    "Table",
    "build_table",
    "comm_columns",
    "comm_table",
    "comparison_table",
    "curve_series",
    "curve_tables",
    "curve_values",
    "dice_columns",
    "dice_table",
    "find_runs",
    "group_by_method",
    "load_run",
    "load_runs",
    "main",
    "outfed_table",
    "paired_dice_table",
    "per_class_table",
    "run_average",
    "site_names",
    "site_value",
    "sites_table",
    "size_value",
    "timing_table",
    "write_tables",
]

log = logging.getLogger(__name__)

RUN_FILES: tuple[str, ...] = ("config.yaml", "metrics.jsonl", "comm.jsonl", "final.json")
STD_DDOF = 1
METRIC_LABELS: dict[str, str] = {
    "dice": "Dice (%)",
    "iou": "IoU (%)",
    "hd95": "HD95 (px)",
    "assd": "ASSD (px)",
}
HIGHER_IS_BETTER: dict[str, bool] = {"dice": True, "iou": True, "hd95": False, "assd": False}
DIGITS = 2


class RunError(ValueError):
    """A run directory that cannot be read; the message names the directory and the file."""


# ---------------------------------------------------------------------------------------------
# Loading runs


def _is_run_dir(path: Path) -> bool:
    return any((path / name).is_file() for name in RUN_FILES)


def find_runs(paths: Iterable[str | Path]) -> list[Path]:
    """Run directories among ``paths`` and below them (Hydra multirun dirs), sorted, unique.

    A directory is a run when it holds any of :data:`RUN_FILES`; Hydra's own ``.hydra`` folders
    are not runs.
    """
    found: set[Path] = set()
    for raw in paths:
        root = Path(raw)
        if not root.is_dir():
            raise RunError(f"{root}: not a directory; pass a run directory or a multirun directory")
        if _is_run_dir(root):
            found.add(root)
            continue
        below = {
            f.parent
            for name in RUN_FILES
            for f in root.rglob(name)
            if ".hydra" not in f.relative_to(root).parts
        }
        if not below:
            raise RunError(f"{root}: no run directory below it (none holds any of {RUN_FILES})")
        found.update(below)
    return sorted(found)


def _read_jsonl(path: Path) -> list[dict]:
    """run_io.read_jsonl (a last line cut short by a killed writer is skipped with a warning)."""
    try:
        return read_jsonl(path)
    except ValueError as err:
        raise RunError(str(err)) from err


def load_run(path: str | Path) -> dict:
    """One run: {"path", "method", "seed", "experiment", "config", "final", "metrics", "comm",
    "train"} ("train": rows of train.jsonl, empty when the run has none).

    Raises :class:`RunError` naming the first missing or unreadable file.
    """
    run_dir = Path(path)
    for name in RUN_FILES:
        if not (run_dir / name).is_file():
            raise RunError(
                f"{run_dir}: incomplete run, missing {name} (a run writes {', '.join(RUN_FILES)}; "
                "final.json appears when training finishes)"
            )
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except yaml.YAMLError as err:
        raise RunError(f"{run_dir / 'config.yaml'}: not valid YAML ({err})") from err
    try:
        final = json.loads((run_dir / "final.json").read_text())
    except json.JSONDecodeError as err:
        raise RunError(f"{run_dir / 'final.json'}: not valid JSON ({err.msg})") from err
    for key in ("method", "seed", "sites"):
        if key not in final:
            raise RunError(f"{run_dir / 'final.json'}: missing key {key!r}")
    return {
        "path": run_dir,
        "method": str(final["method"]),
        "seed": final["seed"],
        "experiment": final.get(
            "experiment", config.get("experiment") if isinstance(config, Mapping) else None
        ),
        "config": config,
        "final": final,
        "metrics": _read_jsonl(run_dir / "metrics.jsonl"),
        "comm": _read_jsonl(run_dir / "comm.jsonl"),
        "train": _read_jsonl(run_dir / "train.jsonl")
        if (run_dir / "train.jsonl").is_file()
        else [],
    }


def load_runs(paths: Iterable[str | Path], skip_incomplete: bool = False) -> list[dict]:
    """Load every run in ``paths`` (run or multirun directories, see :func:`find_runs`).

    An incomplete run raises :class:`RunError`, or is skipped with a warning when
    ``skip_incomplete``.
    """
    paths = list(paths)
    runs = []
    for run_dir in find_runs(paths):
        try:
            runs.append(load_run(run_dir))
        except RunError as err:
            if not skip_incomplete:
                raise
            log.warning("skipping %s", err)
    if not runs:
        raise RunError(f"no complete run found in {[str(p) for p in paths]}")
    return runs


def _experiment_label(experiment: object) -> str:
    if isinstance(experiment, Mapping):
        return str(experiment.get("name", experiment))
    return str(experiment)


def group_by_method(runs: Sequence[dict]) -> dict[str, list[dict]]:
    """Runs grouped by method, in order of first appearance.

    When the runs come from more than one experiment, the label is "method [experiment]".
    """
    experiments = {_experiment_label(r.get("experiment")) for r in runs}
    groups: dict[str, list[dict]] = {}
    for run in runs:
        label = run["method"]
        if len(experiments) > 1:
            label = f"{label} [{_experiment_label(run.get('experiment'))}]"
        groups.setdefault(label, []).append(run)
    for label, group in groups.items():
        seeds = [r["seed"] for r in group]
        if len(set(map(str, seeds))) < len(seeds):
            log.warning("%s: several runs share a seed (%s); they are all averaged", label, seeds)
    return groups


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
        """ "mean ± std" with ``digits`` decimals; just the mean for a single run."""
        if self.std is None:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"

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


def _value(scores: Mapping | None, metric: str) -> float | None:
    if not isinstance(scores, Mapping):
        return None
    value = scores.get(metric)
    return None if value is None else float(value)


def site_value(run: dict, section: str, site: str, metric: str) -> float | None:
    """One run's final ``metric`` of ``site`` in ``section``; ``None`` when absent."""
    return _value(run["final"].get(section, {}).get(site), metric)


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


def _std_note() -> str:
    return f"mean ± std over seeds (sample std, ddof={STD_DDOF})"


def sites_table(
    runs: Sequence[dict], metrics: Sequence[str] = ("dice", "iou", "hd95", "assd")
) -> Table:
    """Table II layout: per metric, one column per federated site and Avg. (personalized models)."""
    for metric in metrics:
        if metric not in METRIC_LABELS:
            raise ValueError(f"unknown metric {metric!r}; choose from {list(METRIC_LABELS)}")
    sites = site_names(runs, "sites")
    columns: list[Column] = []
    values: list = []
    for metric in metrics:
        label = METRIC_LABELS[metric]
        for site in sites:
            columns.append(Column(f"{metric}_{site}", f"{label} {site}", metric))
            values.append(lambda r, s=site, m=metric: site_value(r, "sites", s, m))
        columns.append(Column(f"{metric}_avg", f"{label} Avg.", metric))
        values.append(lambda r, m=metric: run_average(r, sites, m))
    title = f"Federated sites {', '.join(sites)} (Table II layout), {_std_note()}"
    return build_table("sites", title, runs, columns, values)


def outfed_table(
    runs: Sequence[dict],
    metrics: Sequence[str] = ("dice", "iou", "hd95", "assd"),
    sites: Sequence[str] | None = None,
) -> Table:
    """Tables III / VIII layout: per out-of-federation site (default: every one the runs have),
    the metrics of the averaged model."""
    sites = list(sites) if sites is not None else site_names(runs, "out_of_federation")
    columns: list[Column] = []
    values: list = []
    for site in sites:
        for metric in metrics:
            columns.append(Column(f"{metric}_{site}", f"{site} {METRIC_LABELS[metric]}", metric))
            values.append(lambda r, s=site, m=metric: site_value(r, "out_of_federation", s, m))
    title = f"Out-of-federation sites {', '.join(sites)} (Tables III / VIII layout), {_std_note()}"
    return build_table("outfed", title, runs, columns, values)


def comparison_table(runs: Sequence[dict]) -> Table:
    """One table: Dice and IoU per federated site, their mean, and each out-of-federation site."""
    sites = site_names(runs, "sites")
    outfed = site_names(runs, "out_of_federation")
    columns: list[Column] = []
    values: list = []
    for site in [*sites, "Avg.", *outfed]:
        for metric in ("dice", "iou"):
            key = "avg" if site == "Avg." else site
            columns.append(Column(f"{metric}_{key}", f"{site} {METRIC_LABELS[metric]}", metric))
            if site == "Avg.":
                values.append(lambda r, m=metric: run_average(r, sites, m))
            elif site in sites:
                values.append(lambda r, s=site, m=metric: site_value(r, "sites", s, m))
            else:
                values.append(lambda r, s=site, m=metric: site_value(r, "out_of_federation", s, m))
    title = f"Comparison: federated sites, their mean and out-of-federation sites, {_std_note()}"
    return build_table("comparison", title, runs, columns, values)


def class_value(run: dict, section: str, site: str, class_name: str, metric: str) -> float | None:
    """One run's final per-class ``metric``; ``None`` when absent or not scored."""
    entry = run["final"].get(section, {}).get(site)
    per_class = entry.get("per_class") if isinstance(entry, Mapping) else None
    return _value(per_class.get(class_name) if isinstance(per_class, Mapping) else None, metric)


def per_class_table(runs: Sequence[dict], metric: str = "dice") -> Table:
    """``metric`` per part class of every site (federated, then out-of-federation).

    A class absent from the ground truth and the prediction of every evaluated frame of a site is
    not scored (``null`` in final.json); its cell shows "n/a", and a mean ± std covers only the
    runs that scored it.
    """
    if metric not in METRIC_LABELS:
        raise ValueError(f"unknown metric {metric!r}; choose from {list(METRIC_LABELS)}")
    columns: list[Column] = []
    values: list = []
    for section in ("sites", "out_of_federation"):
        for site in site_names(runs, section):
            classes: dict[str, None] = {}
            for run in runs:
                entry = run["final"].get(section, {}).get(site)
                if isinstance(entry, Mapping) and isinstance(entry.get("per_class"), Mapping):
                    classes.update(dict.fromkeys(entry["per_class"]))
            for name in classes:
                columns.append(Column(f"{metric}_{site}_{name}", f"{site} {name}", metric))
                values.append(
                    lambda r, sec=section, s=site, c=name: class_value(r, sec, s, c, metric)
                )
    title = (
        f"{METRIC_LABELS[metric]} per class (n/a: class not scored, absent from ground truth and "
        f"prediction in every evaluated frame), {_std_note()}"
    )
    return build_table(f"per_class_{metric}", title, runs, columns, values)


def size_value(run: dict, direction: str, unit: str) -> float | None:
    """A run's mean ``direction`` ("upload" / "download") per site and round in ``unit`` ("mb":
    10^6 bytes, "mib": 2^20 bytes) from final.json. Runs written before final.json carried MiB
    have only MB; their MiB is the exact conversion of it."""
    final = run["final"]
    value = final.get(f"{direction}_{unit}_per_round")
    if value is None and unit == "mib" and final.get(f"{direction}_mb_per_round") is not None:
        value = units.mb_to_mib(float(final[f"{direction}_mb_per_round"]))
    return None if value is None else float(value)


SIZE_NOTE = "MB = 10^6 bytes, MiB = 2^20 bytes (the paper's Table IX figures appear to be MiB)"


def comm_columns() -> tuple[list[Column], list]:
    """Upload and download per site and round, each in MB and MiB (columns, cell values)."""
    columns, values = [], []
    for direction in ("upload", "download"):
        for unit, label in (("mb", "MB"), ("mib", "MiB")):
            columns.append(
                Column(f"{direction}_{unit}_per_round", f"{direction.title()} ({label} / round)")
            )
            values.append(lambda r, d=direction, u=unit: size_value(r, d, u))
    return columns, values


def comm_table(runs: Sequence[dict]) -> Table:
    """Table IX layout: communication per site and round (MB and MiB, from final.json) and rounds
    run (federated rounds; a final stage's one-off exchange is not a round)."""
    columns, values = comm_columns()
    columns.append(Column("rounds", "Rounds", digits=0))
    values.append(
        lambda r: (
            len({row["round"] for row in r["comm"] if row.get("kind", "round") == "round"})
            if r["comm"]
            else None
        )
    )
    table = build_table(
        "comm", f"Communication (Table IX layout), {_std_note()}", runs, columns, values
    )
    table.notes.append(SIZE_NOTE)
    return table


def dice_columns(
    sites: Sequence[str], outfed: Sequence[str] = ("E",), metric: str = "dice"
) -> tuple[list[Column], list]:
    """``metric`` per federated site, their Avg. and each out-of-federation site (averaged
    model): the columns of Tables IV-VII and Fig. 7, with their cell values."""
    label = METRIC_LABELS[metric]
    columns: list[Column] = []
    values: list = []
    for site in sites:
        columns.append(Column(f"{metric}_{site}", f"{label} {site}", metric))
        values.append(lambda r, s=site: site_value(r, "sites", s, metric))
    columns.append(Column(f"{metric}_avg", f"{label} Avg.", metric))
    values.append(lambda r: run_average(r, sites, metric))
    for site in outfed:
        columns.append(Column(f"{metric}_{site}", f"{label} {site} (out of fed.)", metric))
        values.append(lambda r, s=site: site_value(r, "out_of_federation", s, metric))
    return columns, values


def dice_table(
    runs: Sequence[dict],
    name: str,
    title: str,
    outfed: Sequence[str] = ("E",),
    metric: str = "dice",
) -> Table:
    """Tables IV-VII layout: ``metric`` per federated site, their Avg., and the given
    out-of-federation sites (averaged model)."""
    columns, values = dice_columns(site_names(runs, "sites"), outfed, metric)
    return build_table(name, f"{title}, {_std_note()}", runs, columns, values)


PAIR_VARIANTS = ("without", "with")
"""The two bars of a Fig. 7 pair: without and with synthetic data in training."""


def paired_dice_table(
    pairs: Mapping[str, tuple[Sequence[dict], Sequence[dict]]],
    name: str,
    title: str,
    outfed: Sequence[str] = ("E",),
    metric: str = "dice",
) -> Table:
    """Fig. 7 layout: per method (``pairs``: label -> (runs without, runs with synthetic data)),
    each column of :func:`dice_columns` once per variant, ``<key>_without`` then ``<key>_with``;
    cells are mean ± std over each variant's seeds, "n/a" for a variant without runs. The text
    column "Runs without / with" counts both."""
    all_runs = [run for both in pairs.values() for runs in both for run in runs]
    base_columns, base_values = dice_columns(site_names(all_runs, "sites"), outfed, metric)
    columns = [
        dataclasses.replace(
            column, key=f"{column.key}_{variant}", header=f"{column.header} {variant}"
        )
        for column in base_columns
        for variant in PAIR_VARIANTS
    ]
    table = Table(name=name, title=f"{title}, {_std_note()}", columns=columns)
    table.text_headers = ["Runs without / with"]
    for label, variant_runs in pairs.items():
        table.rows[label] = [
            Stat.of(value(run) for run in runs) for value in base_values for runs in variant_runs
        ]
        table.runs[label] = sum(len(runs) for runs in variant_runs)
        table.texts[label] = [" / ".join(str(len(runs)) for runs in variant_runs)]
    return table


def curve_series(groups: Mapping[str, Sequence[dict]]) -> dict[str, list[dict]]:
    """{label: metrics.jsonl rows of the label's runs, each with its run's "seed"}: what
    :func:`curve_values` and the learning-curve plots read."""
    return {
        label: [{**row, "seed": run["seed"]} for run in runs for row in run["metrics"]]
        for label, runs in groups.items()
    }


def curve_tables(
    groups: Mapping[str, Sequence[dict]], metric: str = "dice", model: str | None = None
) -> list[tuple[str, Table]]:
    """Fig. 5 as tables, from each label's runs (``groups``, rows of :func:`load_run`): one per
    panel, "Average" then each site, with the labels as rows and every evaluated round as a
    column ("r<t>", mean ± std over seeds of :func:`curve_values`, "n/a" where a label has no
    evaluation at that round); then one table with every panel's columns
    (``<metric>_<avg|site>_r<t>``), the CSV. Returns (panel name, table) pairs."""
    series = curve_series(groups)
    values = {label: curve_values(rows, metric, model) for label, rows in series.items()}
    sites = sorted({panel for panels in values.values() for panel in panels} - {AVERAGE_PANEL})
    tables: list[tuple[str, Table]] = []
    combined = Table(name="curves", title="", columns=[])
    for panel in [AVERAGE_PANEL, *sites]:
        key = "avg" if panel == AVERAGE_PANEL else panel
        rounds = sorted({t for panels in values.values() for t in panels.get(panel, {})})
        columns = [Column(f"{metric}_{key}_r{t}", f"r{t}", metric) for t in rounds]
        table = Table(name="curves", title="", columns=columns)
        for label, panels in values.items():
            table.rows[label] = [Stat.of(panels.get(panel, {}).get(t, [])) for t in rounds]
            table.runs[label] = len(groups[label])
            combined.rows[label] = [*combined.rows.get(label, []), *table.rows[label]]
            combined.runs[label] = len(groups[label])
        combined.columns += columns
        tables.append((panel, table))
    return [*tables, ("", combined)]


def _mean_seconds(run: dict, site_is_server: bool, key: str) -> float | None:
    """Mean of ``key`` over a run's train.jsonl rows of rounds >= 1 of the server or of the sites."""
    values = [
        float(row[key])
        for row in run.get("train", [])
        if row.get("round", 0) >= 1 and (row.get("site") == "server") == site_is_server
        if row.get(key) is not None
    ]
    return float(np.mean(values)) if values else None


def _serq_seconds(run: dict) -> float | None:
    """Mean SERQ time per round (EQ + SC) of a run; None without SERQ timings."""
    eq = _mean_seconds(run, True, "eq_seconds")
    sc = _mean_seconds(run, True, "sc_seconds")
    return None if eq is None or sc is None else eq + sc


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def timing_table(runs: Sequence[dict]) -> Table:
    """Wall time per round from train.jsonl: the server's step (aggregation + SERQ) against one
    site's local round (the mean over sites and rounds), and their ratio (the paper's server step
    costs about 4.8x a site's round)."""
    columns = [
        Column("site_seconds", "Site round (s)"),
        Column("aggregation_seconds", "Aggregation (s / round)", digits=3),
        Column("serq_seconds", "SERQ EQ+SC (s / round)"),
        Column("server_seconds", "Server step (s / round)"),
        Column("serq_over_site", "SERQ / site round"),
    ]
    values = [
        lambda r: _mean_seconds(r, False, "seconds"),
        lambda r: _mean_seconds(r, True, "aggregation_seconds"),
        _serq_seconds,
        lambda r: _mean_seconds(r, True, "seconds"),
        lambda r: _ratio(_serq_seconds(r), _mean_seconds(r, False, "seconds")),
    ]
    if not any(run.get("train") for run in runs):
        return Table(name="timing", title="timing", columns=[])
    title = f"Wall time per round (train.jsonl; rounds >= 1), {_std_note()}"
    return build_table("timing", title, runs, columns, values)


def write_tables(runs: Sequence[dict], out_dir: str | Path) -> list[Path]:
    """Write every table as ``<name>.md`` and ``<name>.csv`` plus ``tables.md`` with all of them.

    Tables without columns (e.g. no out-of-federation results) are not written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    markdown: list[str] = []
    tables = (
        sites_table(runs),
        outfed_table(runs),
        comparison_table(runs),
        per_class_table(runs),
        comm_table(runs),
        timing_table(runs),
    )
    for table in tables:
        if not table.columns:
            log.info("no data for table %r; not written", table.name)
            continue
        text = table.to_markdown()
        markdown.append(text)
        md_path = out / f"{table.name}.md"
        md_path.write_text(text)
        written += [md_path, table.to_csv(out / f"{table.name}.csv")]
    combined = out / "tables.md"
    combined.write_text("\n".join(markdown))
    written.append(combined)
    return written


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """Print the markdown tables of the given runs and write tables (and plots) to ``--out``;
    ``msf`` and ``matrix`` as first argument: fedst/report_selection.py."""
    import sys

    from fedst import report_selection

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in report_selection.SUBCOMMANDS:
        return report_selection.main(argv)
    parser = argparse.ArgumentParser(
        prog="python -m fedst.report", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_dirs", nargs="+", help="run directories or Hydra multirun directories")
    parser.add_argument("--out", help="output directory (default: <first RUN_DIR>/report)")
    parser.add_argument(
        "--skip-incomplete", action="store_true", help="warn about and skip unfinished runs"
    )
    parser.add_argument("--no-plots", action="store_true", help="write tables only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    runs = load_runs(args.run_dirs, skip_incomplete=args.skip_incomplete)
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "report"
    written = write_tables(runs, out)
    if not args.no_plots:
        from fedst import plots

        groups = group_by_method(runs)
        written.append(
            plots.plot_learning_curves(
                {m: [row for r in g for row in r["metrics"]] for m, g in groups.items()},
                out / "learning_curves.png",
            )
        )
        written.append(plots.plot_comparison(runs, out / "comparison.png"))
        for method, group in groups.items():
            safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in method)
            if group[0]["comm"]:
                written.append(
                    plots.plot_communication(
                        group[0]["comm"], out / f"communication_{safe}.png", title=method
                    )
                )
    print((out / "tables.md").read_text())
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
