"""The finished runs of a table as the paper lays them out: Table IX's training time and
inference speed (:func:`measure_fps`), the markdown and CSV tables and the figures."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedst.experiment import run_device
from fedst.paper.planning import Plan, PlannedRun
from fedst.paper.tables import Row, RunnerError, synthetic_in_training
from fedst.report import plots, results, tables
from fedst.runs.files import load_config
from fedst.runs.layout import FINAL_JSON, FPS_JSON
from fedst.storage import atomic_write_text

if TYPE_CHECKING:
    import torch

# torch and the scoring stack are imported by the function that measures FPS, so that
# `python -m fedst.paper --help` and a wrong argument answer before they load.

log = logging.getLogger("fedst.paper")

# -- Table IX: training time and inference speed --------------------------------------------------


@dataclass(frozen=True)
class FpsSettings:
    """Inference speed of a run's final model: ``frames`` timed frames after ``warmup`` untimed
    ones, batch 1, streaming in time order through the first federated site's test videos (each
    frame encoded once, earlier frames' features cached, as ``fedst.infer``), frames read into
    memory before timing, ``threads`` torch threads."""

    frames: int = 50
    warmup: int = 5
    threads: int = 1


"""In a run directory: the last FPS measurement and its settings (reused while they match)."""


def measure_fps(run_dir: Path, settings: FpsSettings = FpsSettings()) -> dict[str, Any]:
    """Frames per second of the run's personalized model of its first federated site (see
    :class:`FpsSettings`); stored in ``<run>/fps.json`` and reused while the settings and the
    run's final.json are unchanged."""
    import torch

    from fedst.accel import device_name
    from fedst.infer import load_site_model
    from fedst.scoring.site_data import open_site_data

    path = run_dir / FPS_JSON
    final_mtime = (run_dir / FINAL_JSON).stat().st_mtime_ns
    wanted = dataclasses.asdict(settings)
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("settings") == wanted and cached.get("final_mtime_ns") == final_mtime:
            return cached
    cfg = load_config(run_dir)
    site = cfg.data.federation[0]
    device = run_device(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        _, model, indicator = load_site_model(run_dir, site, None, device)
        dataset = open_site_data(cfg, site, ("test",)).test
        assert dataset is not None
        temporal = model.uses_temporal(dataset.clip_length)
        frames = _video_frames(dataset, settings.warmup + settings.frames, device)
        timed = 0.0
        state, current = None, None
        for index, (video, time_s, frame) in enumerate(frames):
            if video != current:
                state = model.stream(
                    indicator, interval_s=dataset.clip.interval_s, use_temporal=temporal
                )
                current = video
            assert state is not None
            _synchronize(device)
            start = time.perf_counter()
            state.step(frame, time_s)
            _synchronize(device)
            if index >= settings.warmup:
                timed += time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    result = {
        "fps": settings.frames / timed,
        "site": site,
        "device": str(device),
        "device_name": device_name(device),
        "threads": settings.threads,
        "image_size": list(cfg.clip.image_size),
        "temporal": temporal,
        "settings": wanted,
        "final_mtime_ns": final_mtime,
    }
    atomic_write_text(json.dumps(result, indent=2), path)
    return result


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _video_frames(dataset: Any, count: int, device: torch.device) -> list[tuple[int, float, Any]]:
    """``count`` (video index, time s, frame [1, 3, H, W]) in time order through the test videos,
    starting over from the first video when they hold fewer frames."""
    refs = [
        (v, position)
        for v, video in enumerate(dataset.videos)
        for position in range(len(video.frames))
    ]
    if not refs:
        raise RunnerError(f"site {dataset.site_name}: the test split has no frame to time")
    read: dict[tuple[int, int], Any] = {}
    frames = []
    for index in range(count):
        v, position = refs[index % len(refs)]
        if (v, position) not in read:
            frame, _ = dataset.read_frame(dataset.videos[v], position)  # [3, H, W]
            read[(v, position)] = frame[None].to(device)
        # a new pass over the videos restarts the stream (video index made unique per pass)
        frames.append(
            (
                v + len(dataset.videos) * (index // len(refs)),
                dataset.videos[v].times[position],
                read[(v, position)],
            )
        )
    return frames


def training_minutes(run: dict, server: bool) -> float | None:
    """Sum of train.jsonl ``seconds`` over rounds >= 1, of the sites (every site's local rounds:
    the in-process engine runs them one after the other, as on the paper's single GPU) or of the
    server (aggregation + server step), in minutes. A run with site rows but no server rows (no
    server step, e.g. Local) has 0 server time; a run without train.jsonl rows has None."""
    rows = [r for r in run.get("train", []) if r.get("round", 0) >= 1 and "seconds" in r]
    if not rows:
        return None
    return sum(float(r["seconds"]) for r in rows if (r.get("site") == "server") == server) / 60


# -- writing the tables ---------------------------------------------------------------------------


def runs_by_row(plan: Plan) -> dict[Row, list[dict]]:
    """The finished runs of every row (results.load_run), labelled with the row's label."""
    found: dict[Row, list[dict]] = {}
    for run in plan.with_state("done"):
        assert run.run_dir is not None
        loaded = results.load_run(run.run_dir)
        found.setdefault(run.row, []).append({**loaded, "method": run.row.label})
    return found


def _notes(plan: Plan, failures: Sequence[tuple[PlannedRun, str]]) -> list[str]:
    notes = []
    unavailable: dict[Row, str] = {}
    for run in plan.with_state("unavailable"):
        unavailable.setdefault(run.row, run.detail)
    for row, why in unavailable.items():
        notes.append(f"* {row.label}: not available: {why}")
    for run, why in failures:
        notes.append(
            f"* {run.row.label}, seed {run.seed}: failed ({why}; see {run.run_dir}/log.txt)"
        )
    return notes


def build_tables(
    plan: Plan,
    failures: Sequence[tuple[PlannedRun, str]] = (),
    fps: FpsSettings = FpsSettings(),
) -> tuple[list[results.Table], results.Table]:
    """(markdown tables in the paper's layout, the one table written as CSV).

    A kind's builder gives (title part, table) pairs; with several, the last holds every column
    and is the CSV, the others are the markdown (Table II's Dice / IoU and HD95 / ASSD blocks,
    Fig. 5's panels)."""
    spec = plan.spec
    grouped = runs_by_row(plan)
    runs = [run for row in spec.rows for run in grouped.get(row, [])]
    order = list(dict.fromkeys(row.label for row in spec.rows if row in {r.row for r in plan.runs}))
    builders: dict[str, Callable[[Sequence[dict]], list[tuple[str, results.Table]]]] = {
        "sites": lambda rs: [
            (": Dice, IoU", tables.sites_table(rs, ("dice", "iou"))),
            (": HD95, ASSD", tables.sites_table(rs, ("hd95", "assd"))),
            ("", tables.sites_table(rs)),
        ],
        "outfed": lambda rs: [("", tables.outfed_table(rs, sites=[spec.site or ""]))],
        "dice": lambda rs: [("", tables.dice_table(rs, spec.name, spec.caption))],
        "efficiency": lambda rs: [("", _efficiency_table(rs, plan, fps))],
        "curves": lambda rs: [
            (f": {panel}" if panel else "", table)
            for panel, table in tables.curve_tables(results.group_by_method(rs))
        ],
        "paired": lambda rs: [("", _paired_table(plan, grouped))],
    }
    built = [(part, table.arrange(order)) for part, table in builders[spec.kind](runs)]
    for part, table in built:
        table.name = spec.name
        table.title = f"{spec.caption}{part} ({plan.experiment}; {_seed_note(plan)})"
        if spec.mark_headers:
            table.text_headers = list(spec.mark_headers)
            table.texts = {row.label: list(row.marks) for row in spec.rows}
    arranged = [table for _, table in built]
    markdown, csv_table = (
        (arranged[:-1], arranged[-1]) if len(arranged) > 1 else (arranged, arranged[0])
    )
    markdown[-1].notes = [*markdown[-1].notes, *_kind_notes(plan), *_notes(plan, failures)]
    return markdown, csv_table


def _paired_table(plan: Plan, grouped: dict[Row, list[dict]]) -> results.Table:
    """Fig. 7: per label, the runs of its rows without and with synthetic data in training
    (:func:`synthetic_in_training` of each row's config)."""
    uses_synthetic = {run.row: synthetic_in_training(run.cfg) for run in plan.runs if run.cfg}
    pairs: dict[str, tuple[list[dict], list[dict]]] = {}
    for row in dict.fromkeys(run.row for run in plan.runs):  # the selected rows, in order
        without, with_synthetic = pairs.setdefault(row.label, ([], []))
        if row in uses_synthetic:
            (with_synthetic if uses_synthetic[row] else without).extend(grouped.get(row, []))
    return tables.paired_dice_table(
        pairs, plan.spec.name, plan.spec.caption, outfed=[plan.spec.site or ""]
    )


def _kind_notes(plan: Plan) -> list[str]:
    """What a reader of Fig. 5 or Fig. 7 must know about the rows' settings."""
    doubled = {r.row.label for r in plan.runs if r.row.iters_factor != 1}
    notes = []
    if plan.spec.kind == "curves":
        notes = [
            "* Columns: evaluated communication rounds (r<t>); personalized models on each site's "
            "test split; Average: per run the mean over sites A-D, then over seeds.",
            "* Server fine-tuning and Synthetic at the sites are FedST without SERQ (Table IV "
            "row 4), so the three lines differ only in how the synthetic set enters.",
        ]
    elif plan.spec.kind == "paired":
        notes = [
            "* without: Table II's runs (no synthetic data after the pre-training every method "
            "starts from); with: the synthetic set mixed into every site's training data "
            "(the Upper Bound's pool: once). FedST uses it through SERQ and appears once, as is.",
        ]
    if doubled:
        notes.append(
            f"* {', '.join(sorted(doubled))}: train.total_iters doubled (rounds doubled, the same "
            "local iterations per round), as the paper's Sec. IV-C6."
        )
    return notes


def _seed_note(plan: Plan) -> str:
    seeds = ", ".join(map(str, plan.seeds))
    return f"seeds {seeds}; mean ± sample std (ddof={results.STD_DDOF}), one run: its value"


def _efficiency_table(runs: Sequence[dict], plan: Plan, settings: FpsSettings) -> results.Table:
    """Table IX: upload / download per site and round (MB, MiB), training time, FPS."""
    measured: dict[str, dict[str, Any]] = {}
    unmeasured: list[str] = []
    for run in runs:
        try:
            measured[str(run["path"])] = measure_fps(Path(run["path"]), settings)
        except Exception as err:  # the row shows n/a for this run's FPS and says why
            log.exception("FPS of %s not measured", run["path"])
            unmeasured.append(f"* FPS of {run['path']} not measured: {type(err).__name__}: {err}")
    columns, values = tables.comm_columns()
    columns += [
        results.Column("local_minutes", "Local training (min)"),
        results.Column("server_minutes", "Server (min)"),
        results.Column("total_minutes", "Training time (min)"),
        results.Column("fps", "FPS"),
    ]
    values += [
        lambda r: training_minutes(r, server=False),
        lambda r: training_minutes(r, server=True),
        lambda r: _sum(training_minutes(r, server=False), training_minutes(r, server=True)),
        lambda r: measured.get(str(r["path"]), {}).get("fps"),
    ]
    table = results.build_table(plan.spec.name, plan.spec.caption, runs, columns, values)
    table.notes = [
        f"* Communication: parameter values (fp32) per site and round; {tables.SIZE_NOTE}.",
        "* Training time: sum over rounds of every site's local round and of the server step "
        "(aggregation, SERQ), from train.jsonl; the in-process engine runs the sites one after "
        "the other. The synthetic pre-training every method starts from is not included.",
        _fps_note(measured.values(), settings),
        *unmeasured,
    ]
    return table


def _fps_note(measured: Any, settings: FpsSettings) -> str:
    setups = sorted(
        {
            f"{m['device']} ({m['device_name']}), {m['threads']} thread(s), "
            f"{m['image_size'][0]}x{m['image_size'][1]}"
            for m in measured
        }
    )
    where = "; ".join(setups) if setups else "no finished run"
    return (
        f"* FPS: personalized model of the first federated site, batch 1, streaming its test videos "
        f"in time order (earlier frames' features cached), {settings.frames} timed frames after "
        f"{settings.warmup} warm-up frames, frames in memory; measured on {where}."
    )


def _sum(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def write_outputs(
    plan: Plan, markdown: Sequence[results.Table], csv_table: results.Table, out_root: Path
) -> list[Path]:
    """``<out>/<experiment>/<table>.md`` and ``.csv`` (and ``<table>.png`` for Figs. 5, 6, 7)."""
    out = out_root / plan.experiment
    out.mkdir(parents=True, exist_ok=True)
    md_path = out / f"{plan.spec.name}.md"
    atomic_write_text("\n".join(t.to_markdown() for t in markdown), md_path)
    written = [md_path, csv_table.to_csv(out / f"{plan.spec.name}.csv")]
    png = out / f"{plan.spec.name}.png"
    if plan.spec.name == "fig6":
        written.append(
            plots.plot_setting_curves(csv_table, png, "communication every E local iterations")
        )
    elif plan.spec.kind == "curves":
        written += _plot_curves(plan, png)
    elif plan.spec.kind == "paired":
        written.append(_plot_pairs(csv_table, png))
    return written


def _plot_curves(plan: Plan, png: Path) -> list[Path]:
    """Fig. 5's layout: panels Average, A, B, C, D; a line per row in its colour (the row's
    mark), mean with a ±1 std band over seeds. Nothing when no row has a finished run."""
    by_row = runs_by_row(plan)
    grouped = results.group_by_method(
        [run for row in plan.spec.rows for run in by_row.get(row, [])]
    )
    if not grouped:
        log.warning("%s: no finished run, no plot", plan.spec.name)
        return []
    colors = {row.label: row.marks[0] for row in plan.spec.rows if row.marks}
    return [plots.plot_learning_curves(tables.curve_series(grouped), png, colors=colors)]


def _plot_pairs(table: results.Table, png: Path) -> Path:
    """Fig. 7's layout: a panel per site (federated, Avg., out of federation), the methods along
    x, a lighter bar without and a darker bar with synthetic data."""
    without, with_synthetic = tables.PAIR_VARIANTS
    panels = {}
    for column in table.columns:  # keys <metric>_<site | avg>_<variant>
        if column.key.endswith(f"_{without}"):
            stem = column.key.removesuffix(f"_{without}")
            place = stem.split("_", 1)[1]
            title = "Avg." if place == "avg" else f"Site {place}"
            panels[title] = (column.key, f"{stem}_{with_synthetic}")
    return plots.plot_paired_bars(
        table, png, panels, legend=("without synthetic data", "with synthetic data")
    )
