"""Figures: learning curves (paper Fig. 5), communication, per-site comparison bars, and
qualitative overlays (Figs. 3/4). Matplotlib with the Agg backend; each ``*new_figure`` function
builds the matplotlib Figure (tests read its data) and the matching ``plot_*`` / ``qualitative_grid``
writes it as a PNG and returns the path.

Class colours (Okabe-Ito, colour-blind safe) are fixed so that figures of different runs compare:
shaft blue, wrist green, jaw orange; the binary "instrument" class (GraSP) is yellow. Background
and ignore pixels (255) are left as in the image.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from fedst import units
from fedst.report.results import (
    AVERAGE_PANEL,
    METRIC_LABELS,
    STD_DDOF,
    Stat,
    Table,
    curve_values,
    group_by_method,
    run_average,
    site_names,
    site_value,
)
from fedst.schema.labels import IGNORE_INDEX

__all__ = [
    "BINARY_COLORS",
    "PART_COLORS",
    "communication_figure",
    "comparison_figure",
    "learning_curves",
    "learning_curves_figure",
    "overlay_masks",
    "paired_bars_figure",
    "plot_communication",
    "plot_comparison",
    "plot_learning_curves",
    "plot_paired_bars",
    "qualitative_figure",
    "qualitative_grid",
]

PART_COLORS: dict[int, tuple[str, tuple[int, int, int]]] = {
    1: ("shaft", (0, 114, 178)),
    2: ("wrist", (0, 158, 115)),
    3: ("jaw", (230, 159, 0)),
}
BINARY_COLORS: dict[int, tuple[str, tuple[int, int, int]]] = {1: ("instrument", (240, 228, 66))}
DPI = 120

MetricRows = Sequence[Mapping]


def new_figure(
    nrows: int, ncols: int, figsize: tuple[float, float], **kwargs
) -> tuple[Figure, np.ndarray]:
    """A pyplot-free figure and its axes as a 2-D array [nrows, ncols]."""
    fig = Figure(figsize=figsize)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kwargs)
    return fig, axes


def save_figure(fig: Figure, out_png: str | Path) -> Path:
    path = Path(out_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


Curve = tuple[list[int], np.ndarray, np.ndarray]


def _mean_band(values_by_round: Mapping[int, list[float]]) -> Curve:
    """(rounds, mean, std) over the values of each round; std as in the tables, 0 for one run."""
    rounds = sorted(values_by_round)
    means = np.array([np.mean(values_by_round[t]) for t in rounds])
    stds = np.array(
        [
            np.std(values_by_round[t], ddof=STD_DDOF) if len(values_by_round[t]) > 1 else 0.0
            for t in rounds
        ]
    )
    return rounds, means, stds


def learning_curves(
    metrics_rows: MetricRows | Mapping[str, MetricRows],
    metric: str = "dice",
    model: str | None = None,
) -> dict[str, dict[str, Curve]]:
    """{label: {"Average" | site: (rounds, mean, std)}}: the data of :func:`plot_learning_curves`,
    the per-round values of :func:`fedst.report.results.curve_values` summarised over seeds."""
    series = dict(metrics_rows) if isinstance(metrics_rows, Mapping) else {"run": metrics_rows}
    return {
        label: {
            name: _mean_band(values)
            for name, values in curve_values(rows, metric, model).items()
            if values
        }
        for label, rows in series.items()
    }


def plot_learning_curves(
    metrics_rows: MetricRows | Mapping[str, MetricRows],
    out_png: str | Path,
    metric: str = "dice",
    model: str | None = None,
    colors: Mapping[str, str] | None = None,
) -> Path:
    """Write :func:`learning_curves_figure` to ``out_png``."""
    return save_figure(learning_curves_figure(metrics_rows, metric, model, colors), out_png)


def learning_curves_figure(
    metrics_rows: MetricRows | Mapping[str, MetricRows],
    metric: str = "dice",
    model: str | None = None,
    colors: Mapping[str, str] | None = None,
) -> Figure:
    """Test ``metric`` vs communication round (paper Fig. 5): "Average", then a panel per site.

    ``metrics_rows``: rows of metrics.jsonl, or {label: rows} to overlay methods; several seeds
    under one label are drawn as their mean with a ±1 std band (see :func:`learning_curves`).
    ``model``: "personal" / "global"; default: personal rows where present, else global.
    ``colors``: a matplotlib colour per label (Fig. 5: blue, green, red); others: the cycle's.
    """
    curves = learning_curves(metrics_rows, metric, model)
    sites = sorted({p for panels in curves.values() for p in panels} - {AVERAGE_PANEL})
    if not sites:
        raise ValueError(
            f"no test rows with a site and {metric!r} to plot in {list(curves)} (model={model!r})"
        )
    panel_names = [AVERAGE_PANEL, *sites]
    fig, grid = new_figure(1, len(panel_names), (3.4 * len(panel_names), 3.2), sharey=True)
    axes = grid[0]
    for label, panels in curves.items():
        color = (colors or {}).get(label)
        for ax, name in zip(axes, panel_names, strict=True):
            if name not in panels:
                continue
            rounds, means, stds = panels[name]
            (line,) = ax.plot(rounds, means, marker="o", markersize=3, label=label, color=color)
            color = line.get_color()
            ax.fill_between(rounds, means - stds, means + stds, color=color, alpha=0.2)
    for ax, name in zip(axes, panel_names, strict=True):
        ax.set_title(name if name == AVERAGE_PANEL else f"Site {name}")
        ax.set_xlabel("Communication round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"Test {METRIC_LABELS.get(metric, metric)}")
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    axes[0].legend(handles, labels, fontsize=8)
    return fig


def plot_communication(
    comm_rows: Sequence[Mapping], out_png: str | Path, title: str | None = None
) -> Path:
    """Write :func:`communication_figure` to ``out_png``."""
    return save_figure(communication_figure(comm_rows, title), out_png)


def communication_figure(comm_rows: Sequence[Mapping], title: str | None = None) -> Figure:
    """Upload and download per round, stacked by site (rows of comm.jsonl): MB (10^6 bytes) on
    the left axis, MiB (2^20 bytes) on the right.

    Stacking keeps sites that send identical amounts visible; the top edge is the round's total.
    A site absent from a round (not sampled) contributes 0 there. Rows of a method's final stage
    (``kind`` other than "round", e.g. FedDP's exchange of personalized parameters, logged as
    round T + 1) are stacked at their round and labelled with their kind.
    """
    if not comm_rows:
        raise ValueError("plot_communication got no rows (comm.jsonl is empty)")
    sites = sorted({str(r["site"]) for r in comm_rows})
    rounds = sorted({int(r["round"]) for r in comm_rows})
    round_index = {t: i for i, t in enumerate(rounds)}
    fig, grid = new_figure(1, 2, (10, 3.4), sharex=True)
    for ax, key, name in zip(
        grid[0], ("upload_bytes", "download_bytes"), ("Upload", "Download"), strict=True
    ):
        megabytes = np.zeros((len(sites), len(rounds)))  # (sites, rounds)
        for row in comm_rows:
            site_row = sites.index(str(row["site"]))
            megabytes[site_row, round_index[int(row["round"])]] += units.megabytes(row[key])
        ax.stackplot(rounds, megabytes, labels=[f"Site {s}" for s in sites], alpha=0.85, step="mid")
        ax.set_title(f"{title}: {name.lower()}" if title else name)
        ax.set_xlabel("Communication round")
        ax.set_ylabel("MB (10^6 bytes) per round, stacked")
        mib = ax.secondary_yaxis("right", functions=(units.mb_to_mib, _mib_to_mb))
        mib.set_ylabel("MiB (2^20 bytes)")
        ax.set_ylim(0, max(float(megabytes.sum(axis=0).max()), 1e-9) * 1.25)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=min(len(sites), 4), loc="upper left")
        stages = {
            int(r["round"]): str(r["kind"]) for r in comm_rows if r.get("kind", "round") != "round"
        }
        for stage_round, kind in stages.items():
            total = float(megabytes[:, round_index[stage_round]].sum())
            ax.annotate(
                f"{kind} (after the last round)",
                (stage_round, total),
                ha="right",
                va="bottom",
                fontsize=7,
            )
    return fig


SERQ_MAGNITUDES = (
    ("descriptor_rms", "RMS of D_sy"),
    ("synthetic_feature_rms", "RMS of F_sy"),
    ("bank_feature_rms", "RMS of F_hat_g"),
    ("global_feature_rms", "RMS of F_g"),
)
"""train.jsonl keys of SERQ's logged magnitudes (fedst/methods/serq.py) and their labels."""


def plot_serq(train_rows: Sequence[Mapping], out_png: str | Path) -> Path | None:
    """Write :func:`serq_figure` to ``out_png``; None (nothing written) without SERQ rows (server
    fine-tuning, serq.mode=finetune, logs no descriptor)."""
    rows = [
        r for r in train_rows if r.get("site") == "server" and r.get("descriptor_rms") is not None
    ]
    return save_figure(serq_figure(rows), out_png) if rows else None


def serq_figure(server_rows: Sequence[Mapping]) -> Figure:
    """SERQ over rounds, from the server rows of train.jsonl: left, the RMS of D_sy against the
    RMS of the features it offsets (Eq. 11); middle, the Eq. 11 and Eq. 12 losses; right, the
    server pull ||gamma after SC - gamma_agg|| / ||gamma_agg - gamma_g^t||."""
    rows = sorted(server_rows, key=lambda r: int(r["round"]))
    rounds = [int(r["round"]) for r in rows]
    fig, grid = new_figure(1, 3, (13, 3.4))
    magnitudes, losses, pull = grid[0]
    for key, label in SERQ_MAGNITUDES:
        magnitudes.plot(rounds, [r[key] for r in rows], marker=".", label=label)
    magnitudes.set_ylabel("RMS over elements")
    magnitudes.set_title("Domain descriptor and features")
    for key, label in (("eq_loss", "L_pre (Eq. 11)"), ("sc_loss", "L_g (Eq. 12)")):
        losses.plot(rounds, [r[key] for r in rows], marker=".", label=label)
    losses.set_title("SERQ losses")
    pull.plot(rounds, [r.get("server_pull") for r in rows], marker=".", color="C3")
    pull.set_title("Server pull (SC change / aggregation change)")
    for ax in grid[0]:
        ax.set_xlabel("Communication round")
        ax.grid(alpha=0.3)
        if ax is not pull:
            ax.legend(fontsize=8)
    return fig


def plot_setting_curves(table: Table, out_png: str | Path, xlabel: str) -> Path:
    """Write :func:`setting_curves_figure` to ``out_png``."""
    return save_figure(setting_curves_figure(table, xlabel), out_png)


def setting_curves_figure(table: Table, xlabel: str) -> Figure:
    """One line per column of ``table`` (e.g. Dice of each site, Avg., E) over its rows (the
    settings, e.g. Fig. 6's communication intervals), mean ± std over seeds; rows without runs
    are gaps."""
    fig, axes = new_figure(1, 1, (7, 3.6))
    ax = axes[0, 0]
    labels = list(table.rows)
    x = np.arange(len(labels))
    for index, column in enumerate(table.columns):
        cells = [table.rows[label][index] for label in labels]
        mean = np.array([np.nan if c is None else c.mean for c in cells])
        std = np.array([0.0 if c is None or c.std is None else c.std for c in cells])
        ax.errorbar(x, mean, yerr=std, marker="o", capsize=3, label=column.header)
    ax.set_xticks(x, labels)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(table.columns[0].header.split(" ")[0] if table.columns else "")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return fig


def plot_paired_bars(
    table: Table,
    out_png: str | Path,
    panels: Mapping[str, tuple[str, str]],
    legend: tuple[str, str],
) -> Path:
    """Write :func:`paired_bars_figure` to ``out_png``."""
    return save_figure(paired_bars_figure(table, panels, legend), out_png)


def paired_bars_figure(
    table: Table, panels: Mapping[str, tuple[str, str]], legend: tuple[str, str]
) -> Figure:
    """Fig. 7 layout: a panel per entry of ``panels`` (title -> (key of the lighter bar's
    column, key of the darker bar's column)), three panels a row; in each, the table's rows
    (methods) along x, each a lighter and a darker bar of the method's colour, mean ± std over
    seeds (a cell without runs: no bar). ``legend``: what the lighter and the darker bar show."""
    index = {column.key: i for i, column in enumerate(table.columns)}
    missing = sorted({key for keys in panels.values() for key in keys} - set(index))
    if missing:
        raise ValueError(f"paired bars: columns {missing} not in table {table.name!r}")
    labels = list(table.rows)
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, grid = new_figure(
        nrows, ncols, (max(4.0, 0.55 * len(labels) + 1.5) * ncols, 3.4 * nrows), sharey=True
    )
    x = np.arange(len(labels))
    width = 0.4
    for ax, (title, keys) in zip(grid.flat, panels.items(), strict=False):
        for offset, key, alpha in zip((-width / 2, width / 2), keys, (0.35, 1.0), strict=True):
            cells = [table.rows[label][index[key]] for label in labels]
            means = [np.nan if c is None else c.mean for c in cells]
            errs = [0.0 if c is None or c.std is None else c.std for c in cells]
            colors = [f"C{i % 10}" for i in range(len(labels))]
            ax.bar(x + offset, means, width, yerr=errs, capsize=2, color=colors, alpha=alpha)
        ax.set_title(title)
        ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    for ax in grid.flat[len(panels) :]:
        ax.set_axis_off()
    for row in grid:
        row[0].set_ylabel(table.columns[0].header.split(" ")[0] if table.columns else "")
    handles = [
        Patch(color="grey", alpha=alpha, label=text)
        for text, alpha in zip(legend, (0.35, 1.0), strict=True)
    ]
    fig.legend(handles=handles, loc="upper center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def _mib_to_mb(mib: float) -> float:
    return mib * units.BYTES_PER_MIB / units.BYTES_PER_MB


def plot_comparison(runs: Sequence[dict], out_png: str | Path, metric: str = "dice") -> Path:
    """Write :func:`comparison_figure` to ``out_png``."""
    return save_figure(comparison_figure(runs, metric), out_png)


def comparison_figure(runs: Sequence[dict], metric: str = "dice") -> Figure:
    """Bars of final ``metric`` per site (federated, Avg., out-of-federation) per method, ±std."""
    sites = site_names(runs, "sites")
    outfed = site_names(runs, "out_of_federation")
    categories = [*sites, "Avg.", *outfed]
    groups = group_by_method(runs)
    width = 0.8 / max(len(groups), 1)
    fig, grid = new_figure(1, 1, (max(6.0, 0.45 * len(categories) * len(groups) + 3), 3.6))
    ax = grid[0, 0]
    for i, (method, group) in enumerate(groups.items()):
        stats: list[Stat | None] = []
        for site in categories:
            if site == "Avg.":
                values = [run_average(r, sites, metric) for r in group]
            elif site in sites:
                values = [site_value(r, "sites", site, metric) for r in group]
            else:
                values = [site_value(r, "out_of_federation", site, metric) for r in group]
            stats.append(Stat.of(values))
        xs = np.arange(len(categories)) + (i - (len(groups) - 1) / 2) * width
        means = [s.mean if s else np.nan for s in stats]
        errs = [s.std if s and s.std is not None else 0.0 for s in stats]
        ax.bar(xs, means, width, yerr=errs, capsize=2, label=method)
    ax.set_xticks(
        np.arange(len(categories)), [c if c == "Avg." else f"Site {c}" for c in categories]
    )
    if outfed:
        ax.axvline(len(sites) + 0.5, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel(f"Final test {METRIC_LABELS.get(metric, metric)}")
    ax.set_title(
        f"{METRIC_LABELS.get(metric, metric)} per site (right of dashed line: out of federation)"
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(len(groups), 4))
    return fig


def overlay_masks(
    image_rgb: np.ndarray, mask: np.ndarray, alpha: float = 0.5, binary: bool = False
) -> np.ndarray:
    """Blend class colours into an RGB uint8 image [H, W, 3] where mask [H, W] is a foreground
    class: out = round((1 - alpha) * image + alpha * colour); other pixels are unchanged."""
    image_rgb = np.asarray(image_rgb)
    mask = np.asarray(mask)
    if image_rgb.dtype != np.uint8 or image_rgb.ndim != 3 or image_rgb.shape[2] != 3:
        raise ValueError(
            f"image_rgb must be uint8 [H, W, 3], got dtype {image_rgb.dtype} "
            f"shape {image_rgb.shape}"
        )
    if mask.shape != image_rgb.shape[:2]:
        raise ValueError(
            f"mask shape {mask.shape} does not match image shape {image_rgb.shape[:2]}"
        )
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    colors = BINARY_COLORS if binary else PART_COLORS
    out = image_rgb.copy()
    for value, (_, color) in colors.items():
        where = mask == value
        blended = (1.0 - alpha) * image_rgb[where].astype(np.float64) + alpha * np.array(color)
        out[where] = np.clip(np.round(blended), 0, 255).astype(np.uint8)
    return out


def _merge_parts(mask: np.ndarray) -> np.ndarray:
    """Part classes -> 1 (instrument), ignore stays ignore: how a binary site is scored."""
    mask = np.asarray(mask)
    return np.where(mask == IGNORE_INDEX, IGNORE_INDEX, mask > 0).astype(np.int64)


def _row_overlay(image: np.ndarray, mask: np.ndarray, alpha: float, binary: bool) -> np.ndarray:
    return overlay_masks(image, _merge_parts(mask) if binary else mask, alpha, binary)


def qualitative_grid(
    rows: Sequence[tuple],
    out_png: str | Path,
    binary: bool = False,
    alpha: float = 0.5,
) -> Path:
    """Write :func:`qualitative_figure` to ``out_png``."""
    return save_figure(qualitative_figure(rows, binary, alpha), out_png)


def qualitative_figure(rows: Sequence[tuple], binary: bool = False, alpha: float = 0.5) -> Figure:
    """Figs. 3/4: a row per (title, image, gt, {method: pred}); columns image, GT, each method.

    image: RGB uint8 [H, W, 3]; gt, pred: class maps [H, W]. A row may carry a fifth element, a
    bool that marks a binary site (GraSP): its predicted parts are then shown merged as
    instrument, as they are scored. Rows without it use ``binary``.
    """
    if not rows:
        raise ValueError("qualitative_grid got no rows")
    methods: dict[str, None] = {}
    for row in rows:
        if len(row) not in (4, 5):
            raise ValueError(
                f"qualitative_grid row {row[0]!r} has {len(row)} elements; expected "
                "(title, image, gt, {method: pred}) with an optional binary flag"
            )
        methods.update(dict.fromkeys(row[3]))
    columns = ["Image", "Ground truth", *methods]
    height, width = np.asarray(rows[0][1]).shape[:2]
    cell = 2.4
    fig, axes = new_figure(
        len(rows), len(columns), (cell * len(columns), cell * height / width * len(rows) + 0.6)
    )
    palettes: dict[str, dict[int, tuple[str, tuple[int, int, int]]]] = {}
    for r, row in enumerate(rows):
        title, image, gt, preds = row[:4]
        row_binary = bool(row[4]) if len(row) == 5 else binary
        palettes["binary" if row_binary else "parts"] = BINARY_COLORS if row_binary else PART_COLORS
        panels = [np.asarray(image), _row_overlay(image, gt, alpha, row_binary)]
        panels += [
            _row_overlay(image, preds[m], alpha, row_binary) if m in preds else None
            for m in methods
        ]
        for c, panel in enumerate(panels):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            if panel is None:
                ax.set_axis_off()
                continue
            ax.imshow(panel)
            if r == 0:
                ax.set_title(columns[c], fontsize=9)
        axes[r, 0].set_ylabel(title, fontsize=9)
    handles = [
        Patch(color=np.array(color) / 255, label=name)
        for palette in palettes.values()
        for name, color in palette.values()
    ]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.3 / (cell * height / width * len(rows) + 0.6), 1, 1))
    return fig
