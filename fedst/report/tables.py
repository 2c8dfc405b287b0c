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

``msf`` and ``matrix``: fedst/report/selection.py.

A RUN_DIR may also be a Hydra multirun directory: every run directory below it is used. A row
pools only runs whose configs differ in the seed alone; runs of one method that differ otherwise
get rows of their own (:func:`fedst.report.results.group_by_method` says why). A folder that is not a
finished run is an error naming it, or with ``--skip-incomplete`` skipped in one warning line.
Every score is printed rounded once from its unrounded value (:func:`fedst.scoring.formatting.format_score`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedst import units
from fedst.errors import ArgumentParser
from fedst.report.results import (
    AVERAGE_PANEL,
    METRIC_LABELS,
    STD_DDOF,
    Column,
    Stat,
    Table,
    build_table,
    curve_values,
    group_by_method,
    load_runs,
    metric_value,
    run_average,
    site_names,
    site_value,
)
from fedst.runs.layout import SITE_STATS_JSON
from fedst.storage import require_output_folder

__all__ = [
    "challenge_table",
    "comm_columns",
    "comm_table",
    "comparison_table",
    "curve_series",
    "curve_tables",
    "default_out",
    "dice_columns",
    "dice_table",
    "main",
    "outfed_table",
    "paired_dice_table",
    "per_class_table",
    "sites_table",
    "size_value",
    "timing_table",
    "write_tables",
]

log = logging.getLogger(__name__)


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
    columns, values = _site_and_average_columns(runs, ("dice", "iou"))
    title = f"Comparison: federated sites, their mean and out-of-federation sites, {_std_note()}"
    return build_table("comparison", title, runs, columns, values)


CHALLENGE_TABLE_METRICS = ("dice", "iou", "challenge_iou", "isi_iou", "mciou")
"""The EndoVis literature's IoUs (fedst/scoring/challenge.py) beside the paper's Dice and IoU."""


def challenge_table(runs: Sequence[dict]) -> Table:
    """Per federated site, their mean and each out-of-federation site: Dice and IoU beside the
    challenge IoU, ISI IoU and mcIoU (a run scored before these existed shows "n/a")."""
    columns, values = _site_and_average_columns(runs, CHALLENGE_TABLE_METRICS)
    title = (
        f"EndoVis IoUs beside Dice / IoU: federated sites, their mean and out-of-federation "
        f"sites (docs/model-selection.md, metric definitions), {_std_note()}"
    )
    return build_table("challenge", title, runs, columns, values)


def _site_and_average_columns(runs: Sequence[dict], metrics: Sequence[str]) -> tuple[list, list]:
    """Columns (and their value functions) of ``metrics`` for each federated site, their mean
    ("Avg.") and each out-of-federation site, in that order."""
    sites = site_names(runs, "sites")
    outfed = site_names(runs, "out_of_federation")
    columns: list[Column] = []
    values: list = []
    for site in [*sites, "Avg.", *outfed]:
        for metric in metrics:
            key = "avg" if site == "Avg." else site
            columns.append(Column(f"{metric}_{key}", f"{site} {METRIC_LABELS[metric]}", metric))
            if site == "Avg.":
                values.append(lambda r, m=metric: run_average(r, sites, m))
            elif site in sites:
                values.append(lambda r, s=site, m=metric: site_value(r, "sites", s, m))
            else:
                values.append(lambda r, s=site, m=metric: site_value(r, "out_of_federation", s, m))
    return columns, values


def class_value(run: dict, section: str, site: str, class_name: str, metric: str) -> float | None:
    """One run's final per-class ``metric``; ``None`` when absent or not scored."""
    entry = run["final"].get(section, {}).get(site)
    per_class = entry.get("per_class") if isinstance(entry, Mapping) else None
    return metric_value(
        per_class.get(class_name) if isinstance(per_class, Mapping) else None, metric
    )


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
        challenge_table(runs),
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


def _usage() -> str:
    from fedst.report.selection import RULE_ORDER

    prog = "python -m fedst.report"
    return (
        f"{prog} RUN_DIR [RUN_DIR ...] [--out DIR] [--skip-incomplete] [--no-plots]\n"
        f"       {prog} msf RUN_DIR [RUN_DIR ...] [--out DIR]\n"
        f"       {prog} matrix RUN_DIR [--rule {{{','.join(RULE_ORDER)}}}] [--out DIR]"
    )


def _epilog() -> str:
    from fedst.report.selection import SUBCOMMANDS

    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, text in SUBCOMMANDS.items()]
    return "\n".join(
        [
            "subcommands (the first argument; python -m fedst.report <subcommand> --help):",
            *lines,
            "",
            "A row pools the runs of one method whose configs differ in the seed alone; runs that",
            "differ in anything else get rows of their own, labelled with the keys that differ.",
        ]
    )


def default_out(run_dirs: Sequence[str | Path], runs: Sequence[dict]) -> Path:
    """``<first RUN_DIR that holds a reported run>/report`` (a skipped folder gets no report)."""
    paths = [Path(run["path"]) for run in runs]
    for raw in run_dirs:
        root = Path(raw)
        if any(path == root or root in path.parents for path in paths):
            return root / "report"
    return paths[0] / "report"


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """Print the markdown tables of the given runs and write tables (and plots) to ``--out``;
    ``msf`` and ``matrix`` as first argument: fedst/report/selection.py."""
    import sys

    from fedst.report import selection

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in selection.SUBCOMMANDS:
        return selection.main(argv)
    parser = ArgumentParser(
        prog="python -m fedst.report",
        usage=_usage(),
        description=__doc__.split("\n")[0],
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dirs", nargs="+", help="run directories or Hydra multirun directories")
    parser.add_argument(
        "--out", help="output directory (default: <first RUN_DIR with a reported run>/report)"
    )
    parser.add_argument(
        "--skip-incomplete",
        action="store_true",
        help="skip, with one warning line each, folders that are not finished runs (a run "
        "still training or stopped early, an unreadable run, a report's or the demo's output "
        "folder, any other folder or file); without it, each is an error",
    )
    parser.add_argument("--no-plots", action="store_true", help="write tables only")
    args = parser.parse_args(argv)
    if args.out:  # before any run is read
        require_output_folder(Path(args.out), "--out")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    runs = load_runs(args.run_dirs, skip_incomplete=args.skip_incomplete)
    out = Path(args.out) if args.out else default_out(args.run_dirs, runs)
    written = write_tables(runs, out)
    if not args.no_plots:
        from fedst.report import plots

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
    from fedst.data.stats import format_statistics  # imports torch: after the arguments parse

    for run in runs:  # the data each site reported before training (fedst/data/stats.py)
        stats_file = Path(run["path"]) / SITE_STATS_JSON
        if stats_file.is_file():
            site_stats = json.loads(stats_file.read_text())
            print(f"\nSite statistics before training, {run['path']}:")
            print(format_statistics(site_stats["sites"]))
            for line in site_stats["warnings"]:
                print(f"WARNING {line}")
    for path in written:
        print(f"wrote {path}")
    return written
