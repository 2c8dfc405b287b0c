"""One command per table of the paper: train the runs a table needs, then write the table.

    python -m fedst.experiments table2 [--dry-run] [seeds=0,1,2] [experiment=demo]
    python -m fedst.experiments table4 [--runs runs] [--out results] [rows=table4_row2_ts]

The table (first argument) is one of :data:`TABLES`: ``table2`` (sites A-D: Dice / IoU / HD95 / ASSD per site and
Avg.), ``table3`` (site E, out of federation), ``table8`` (GraSP, binary), ``table9``
(communication per site and round in MB and MiB, training time, inference FPS), ``table4`` ..
``table7`` (the ablation rows of configs/ablation/), ``fig6`` (communication interval), ``fig5``
(learning curves of three ways to use the synthetic set: server fine-tuning, synthetic data at
the sites, SERQ) and ``fig7`` (every method without and with the synthetic set mixed into every
site's training data, iterations doubled; the "without" runs are Table II's).

Each table declares its rows (a method of configs/method/ or an ablation of configs/ablation/, in
the paper's order); every row runs once per seed. A run is table-independent: its directory is
``<runs>/<experiment name>/<row name>_s<seed>/`` (Tables II, III, VIII and IX and Fig. 7's
"without" bars share the same eight methods' runs). A row may be an ablation applied to another
method than FedST (Fig. 7: ``method=fedavg +ablation=fig7_synthetic``) and may scale
``train.total_iters`` by a factor of the experiment's (Fig. 7 and Fig. 5's green line: x2; the
rounds, total_iters // local_iters, double with it). For each run the runner

* skips it when it is finished: ``final.json`` present and the run's ``config.json`` equal to the
  config the command composes (up to ``train.eval_every / device / num_workers``, which do not
  change what a run learns: fedst/cli.py RESUME_SAFE_KEYS);
* resumes it when it was interrupted (``checkpoints/server.pt`` present: the resume machinery of
  ``fedst.training.run_training``, as ``train_fed.py resume=...``);
* trains it otherwise, through the same entry as train_fed.py (``run_training``), logging
  ``run i/N`` and the elapsed time;
* refuses to start when a run directory holds a run of another config (the differing keys are
  named; use another ``--runs`` folder or delete that directory).

A row whose config file does not exist (a method not implemented yet) or does not compose stays
in the table as "n/a" with 0 runs and a note saying why; it is never dropped. A run that fails is
logged, the others still run, its row shows the runs that finished, and the command exits with 1.
The tables (markdown and CSV) go to ``<out>/<experiment name>/<TABLE>.md|csv`` (``<out>``:
``results``, or ``<runs>/results`` when ``--runs`` is not the default): mean ± sample std
over seeds (fedst/report.py); Figs. 5, 6 and 7 also write ``<TABLE>.png`` there. ``--dry-run``
lists every run, its state and the overrides the row adds, and trains nothing.

Seeds and rows are the runner's own keys (``seeds=0,1,2``, ``rows=local,fedavg``); every other
argument is a Hydra override applied to every run (``experiment=demo``, ``train.device=cpu``);
``seed=``, ``method=``, ``+ablation=``, ``resume=`` and ``site=`` are the runner's to set and are
refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedst import plots, report, results
from fedst.accel import device_name
from fedst.cli import CONFIG_DIR, compose_experiment, learning_differences, setup_logging
from fedst.config import ConfigError
from fedst.experiment import ExperimentConfig, resolve_device
from fedst.federation.run_io import atomic_write_text, load_config
from fedst.federation.server import SERVER_CHECKPOINT
from fedst.federation.site_data import open_site_data
from fedst.training import run_training

log = logging.getLogger("fedst.experiments")

DEFAULT_SEEDS = (0, 1, 2)
"""The paper repeats every experiment with three seeds (Sec. IV-A3)."""
RUNNER_KEYS = ("seeds", "rows")
REFUSED_KEYS = ("seed", "resume", "site", "method", "ablation")


class RunnerError(ValueError):
    """A runner request that cannot be carried out; the message names the key or file and the fix."""


# -- what a table needs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One row of a table: a method (``configs/method/<name>.yaml``) or an ablation
    (``configs/ablation/<name>.yaml``, applied on top of the default method, FedST)."""

    label: str
    name: str
    """The row's key (``rows=``) and run directory stem (``<name>_s<seed>``)."""
    group: str = "method"
    marks: tuple[str, ...] = ()
    """Descriptive cells of the row (Table IV's component ticks, Table V's personalized layers,
    Fig. 5's line colour)."""
    config: str | None = None
    """The config file of ``group`` when it is not ``name`` (Fig. 7: every method's
    ``<method>_synthetic`` row is the one ablation fig7_synthetic)."""
    method: str | None = None
    """An ablation row's method (``method=<name>``); None: the default method, FedST."""
    iters_factor: int = 1
    """``train.total_iters`` of the row's runs as a multiple of the experiment's (Fig. 7, Fig.
    5's green line: 2, the paper's doubled iterations); the rounds follow it (:func:`compose_row`)."""

    @property
    def config_files(self) -> tuple[Path, ...]:
        """The config files the row composes: its own, and its method's for an ablation on one."""
        own = CONFIG_DIR / self.group / f"{self.config or self.name}.yaml"
        return (*([CONFIG_DIR / "method" / f"{self.method}.yaml"] if self.method else []), own)

    def overrides(self) -> list[str]:
        config = self.config or self.name
        if self.group == "method":
            return [f"method={config}"]
        return [*([f"method={self.method}"] if self.method else []), f"+ablation={config}"]


@dataclass(frozen=True)
class TableSpec:
    """A table of the paper: its rows in the paper's order and how its cells are computed."""

    name: str
    caption: str
    rows: tuple[Row, ...]
    kind: str
    """"sites" (Table II), "outfed" (Tables III / VIII), "efficiency" (Table IX), "dice"
    (Tables IV-VII, Fig. 6: Dice per federated site, Avg. and site E), "curves" (Fig. 5: Dice
    per site and Avg. at every evaluated round) or "paired" (Fig. 7: Dice per site, Avg. and
    site E without and with synthetic data in training, rows of one label paired)."""
    site: str | None = None
    """The out-of-federation site of an "outfed" table."""
    mark_headers: tuple[str, ...] = ()


def _methods(*pairs: tuple[str, str]) -> tuple[Row, ...]:
    return tuple(Row(label, name) for label, name in pairs)


def _ablations(*rows: tuple[str, str, tuple[str, ...]]) -> tuple[Row, ...]:
    return tuple(Row(label, name, "ablation", marks) for label, name, marks in rows)


def _variants(table: str, **suffixes: str) -> tuple[Row, ...]:
    """Ablations ``configs/ablation/<table>_<suffix>.yaml``, labelled by keyword, in order."""
    return tuple(Row(label, f"{table}_{suffix}", "ablation") for label, suffix in suffixes.items())


LOCAL, UPPER, FEDST = ("Local Train", "local"), ("Upper Bound", "upperbound"), ("FedST", "fedst")
FEDLD, FEDDP, FEDAVG = ("FedLD", "fedld"), ("FedDP", "feddp"), ("FedAvg", "fedavg")
FEDREP, FEDAS = ("FedRep", "fedrep"), ("FedAS", "fedas")
X = "x"
TABLE_II_ORDER = _methods(LOCAL, UPPER, FEDLD, FEDDP, FEDAVG, FEDREP, FEDAS, FEDST)
"""Table II's row order (the paper's Tables III, VIII and IX list the same methods in another)."""
TABLE_III_ORDER = _methods(LOCAL, UPPER, FEDDP, FEDAS, FEDLD, FEDAVG, FEDREP, FEDST)

SYNTHETIC_IN_SITES = "fig7_synthetic"
"""The ablation that mixes the synthetic set into every site's training data (Fig. 7)."""
DOUBLED = 2
"""Fig. 7 (Sec. IV-C6): "the number of training iterations is doubled" with synthetic data."""


def _with_and_without_synthetic(*pairs: tuple[str, str]) -> tuple[Row, ...]:
    """Fig. 7's rows: each baseline as in Table II (its run directory), then the same method with
    the synthetic set mixed into every site's data and train.total_iters doubled; FedST once, as
    it is (its synthetic data enters through SERQ)."""
    rows: list[Row] = []
    for label, name in pairs:
        rows.append(Row(label, name))
        if name != FEDST[1]:
            rows.append(
                Row(
                    label,
                    f"{name}_synthetic",
                    "ablation",
                    config=SYNTHETIC_IN_SITES,
                    method=name,
                    iters_factor=DOUBLED,
                )
            )
    return tuple(rows)


def synthetic_in_training(cfg: ExperimentConfig) -> bool:
    """Whether a run trains with the synthetic set beyond the pre-training every method starts
    from (Fig. 7's darker bars): mixed into the sites' data, or at the server after aggregation
    (SERQ or its fine-tuning). The paper: "all experiments without the SERQ module do not utilize
    any synthetic data during training"."""
    return cfg.data.mix_synthetic or cfg.method.serq


TABLES: dict[str, TableSpec] = {
    spec.name: spec
    for spec in (
        TableSpec(
            "table2",
            "Table II: comparison on the federated sites A-D (personalized models)",
            TABLE_II_ORDER,
            "sites",
        ),
        TableSpec(
            "table3", "Table III: out-of-federation site E", TABLE_III_ORDER, "outfed", site="E"
        ),
        TableSpec(
            "table8",
            "Table VIII: unseen binary segmentation site (GraSP)",
            TABLE_III_ORDER,
            "outfed",
            site="grasp",
        ),
        TableSpec(
            "table9", "Table IX: communication and efficiency", TABLE_III_ORDER, "efficiency"
        ),
        TableSpec(
            "table4",
            "Table IV: ablation of the key components (Dice)",
            _ablations(
                ("1 (FedDP baseline)", "table4_row1_baseline", ("", "", "", "")),
                ("2", "table4_row2_ts", (X, "", "", "")),
                ("3", "table4_row3_ts_prompt", (X, X, "", "")),
                ("4", "table4_row4_ts_prompt_cs", (X, X, X, "")),
                ("5", "table4_row5_serq", ("", "", "", X)),
                ("6", "table4_row6_ts_serq", (X, "", "", X)),
                ("7 (FedST)", "table4_row7_full", (X, X, X, X)),
            ),
            "dice",
            mark_headers=("TS", "Prompt", "CS", "SERQ"),
        ),
        TableSpec(
            "table5",
            "Table V: personalizing different layers of the attention networks (Dice)",
            _ablations(
                ("1 (all shared)", "table5_row1_none", ("", "", "")),
                ("2 (all personalized)", "table5_row2_all", ("Δ", "Δ", "Δ")),
                ("3", "table5_row3_decoder_query", ("", "Δ", "")),
                ("4", "table5_row4_encoder_decoder_query", ("Δ", "Δ", "")),
                ("5 (FedST)", "table5_row5_encoder_query", ("Δ", "", "")),
            ),
            "dice",
            mark_headers=("Encoder Attn.q", "Decoder Attn.q", "Decoder Other"),
        ),
        TableSpec(
            "table6",
            "Table VI: personalized layers of the PVT backbone (Dice)",
            _variants(
                "table6",
                Norm="norm",
                Key="key",
                Value="value",
                **{"Key&Value": "key_value"},
                **{"Ours (Query)": "query"},
            ),
            "dice",
        ),
        TableSpec(
            "table7",
            "Table VII: site indicator of the channel selection network (Dice)",
            _variants(
                "table7",
                Random="random",
                Gaussian="gaussian",
                **{"One-hot": "onehot"},
                **{"Ours (CLIP)": "clip"},
            ),
            "dice",
        ),
        TableSpec(
            "fig5",
            "Fig. 5: learning curves of the ways to use the synthetic set (test Dice)",
            (
                Row("Server fine-tuning", "fig5_server_finetune", "ablation", ("blue",)),
                Row(
                    "Synthetic at the sites",
                    "fig5_local_synthetic",
                    "ablation",
                    ("green",),
                    iters_factor=DOUBLED,
                ),
                Row("SERQ (FedST)", "fig5_serq", "ablation", ("red",)),
            ),
            "curves",
            mark_headers=("Line",),
        ),
        TableSpec(
            "fig7",
            "Fig. 7: Dice without and with synthetic data in training",
            _with_and_without_synthetic(LOCAL, UPPER, FEDLD, FEDDP, FEDAVG, FEDREP, FEDAS, FEDST),
            "paired",
            site="E",
        ),
        TableSpec(
            "fig6",
            "Fig. 6: communication every E local iterations at a fixed total (Dice)",
            _variants("fig6", **{f"every {e}": f"every_{e}" for e in (10, 50, 100, 200, 500)}),
            "dice",
        ),
    )
}


# -- runs: planned, done, to resume, to train -----------------------------------------------------


@dataclass
class PlannedRun:
    row: Row
    seed: int
    run_dir: Path | None
    cfg: ExperimentConfig | None
    state: str
    """"done", "resume", "new", "conflict" (the directory holds another config's run) or
    "unavailable" (no config file, or it does not compose)."""
    detail: str = ""
    overrides: tuple[str, ...] = ()
    """What the row and seed add to the command line's overrides (``method=fedavg
    +ablation=fig7_synthetic seed=0 train.total_iters=800``)."""


@dataclass
class Plan:
    spec: TableSpec
    experiment: str
    seeds: tuple[int, ...]
    runs: list[PlannedRun] = field(default_factory=list)
    runtime: dict[str, Any] = field(default_factory=dict)

    def with_state(self, *states: str) -> list[PlannedRun]:
        return [r for r in self.runs if r.state in states]


def parse_arguments(args: Sequence[str]) -> tuple[tuple[int, ...], list[str] | None, list[str]]:
    """``key=value`` arguments -> (seeds, row names or None for all, Hydra overrides)."""
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    rows: list[str] | None = None
    overrides: list[str] = []
    for arg in args:
        key, _, value = arg.partition("=")
        bare = key.lstrip("+~")
        if bare == "seeds":
            try:
                seeds = tuple(int(v) for v in value.split(",") if v.strip())
            except ValueError as err:
                raise RunnerError(f"seeds={value!r}: give integers, e.g. seeds=0,1,2") from err
            if not seeds or min(seeds) < 0:
                raise RunnerError(f"seeds={value!r}: give non-negative integers, e.g. seeds=0,1,2")
        elif bare == "rows":
            rows = [v for v in value.split(",") if v]
        elif bare in REFUSED_KEYS:
            raise RunnerError(
                f"{arg}: the runner sets {bare} itself (the table's rows choose the method or "
                "ablation, rows=a,b a subset; seeds=0,1,2 the seeds; runs resume automatically); "
                "remove it"
            )
        else:
            overrides.append(arg)
    return seeds, rows, overrides


def plan_table(
    spec: TableSpec,
    seeds: Sequence[int],
    overrides: Sequence[str],
    runs_root: Path,
    rows: Sequence[str] | None = None,
) -> Plan:
    """Every (row, seed) run of ``spec`` with its state; nothing is trained or written."""
    selected = list(spec.rows)
    if rows is not None:
        names = [r.name for r in spec.rows]
        unknown = [name for name in rows if name not in names]
        if unknown:
            raise RunnerError(
                f"rows={','.join(rows)}: {unknown} not in {spec.name} (rows: {names})"
            )
        selected = [r for r in spec.rows if r.name in rows]
    base, runtime = compose_experiment(list(overrides))
    plan = Plan(spec, base.name, tuple(seeds), runtime=runtime)
    for row in selected:
        absent = [f for f in row.config_files if not f.is_file()]
        if absent:
            detail = f"{absent[0].relative_to(CONFIG_DIR.parent)} does not exist (yet)"
            plan.runs += [PlannedRun(row, s, None, None, "unavailable", detail) for s in seeds]
            continue
        for seed in seeds:
            try:
                cfg, own = compose_row(row, seed, overrides)
            except ConfigError as err:
                plan.runs.append(PlannedRun(row, seed, None, None, "unavailable", str(err)))
                continue
            run_dir = runs_root / cfg.name / f"{row.name}_s{seed}"
            state, detail = _run_state(cfg, run_dir)
            if state == "new" and not detail:
                run_dir, state, detail = _same_run_elsewhere(cfg, run_dir, seed) or (
                    run_dir,
                    state,
                    detail,
                )
            plan.runs.append(PlannedRun(row, seed, run_dir, cfg, state, detail, tuple(own)))
    return plan


TOTAL_ITERS_KEY = "train.total_iters"


def compose_row(
    row: Row, seed: int, overrides: Sequence[str]
) -> tuple[ExperimentConfig, list[str]]:
    """The config of ``row``'s run of ``seed`` and the overrides the row adds to ``overrides``.

    With ``row.iters_factor`` k != 1 the row's config is composed twice: first as is, then with
    ``train.total_iters`` = k x the first's (replacing a ``train.total_iters`` of the command
    line, so k scales whatever total the experiment and the command line give). The rounds must
    follow (rounds = total_iters // local_iters, the experiments' ``${fedst.div:...}``), so each
    round keeps E = local_iters local iterations; a config whose rounds do not (``train.rounds``
    set explicitly) is a ConfigError naming the keys."""
    own = [*row.overrides(), f"seed={seed}"]
    cfg, _ = compose_experiment([*overrides, *own])
    if row.iters_factor == 1:
        return cfg, own
    others = [o for o in overrides if o.lstrip("+~").partition("=")[0] != TOTAL_ITERS_KEY]
    own.append(f"{TOTAL_ITERS_KEY}={row.iters_factor * cfg.train.total_iters}")
    scaled, _ = compose_experiment([*others, *own])
    train = scaled.train
    if train.local_iters != cfg.train.local_iters or train.rounds != (
        train.total_iters // train.local_iters
    ):
        raise ConfigError(
            f"{row.name}: {TOTAL_ITERS_KEY} x{row.iters_factor} ({cfg.train.total_iters} -> "
            f"{train.total_iters}) must give {train.total_iters // train.local_iters} rounds of "
            f"train.local_iters={cfg.train.local_iters}, but train.rounds={train.rounds}: leave "
            f"train.rounds to the experiment (rounds = total_iters // local_iters)"
        )
    return scaled, own


def _run_state(cfg: ExperimentConfig, run_dir: Path) -> tuple[str, str]:
    if not (run_dir / "config.json").is_file():
        return "new", ""
    try:
        saved = load_config(run_dir)
    except (ConfigError, ValueError) as err:
        return "conflict", f"{run_dir / 'config.json'} cannot be read ({err})"
    differences = learning_differences(saved, cfg)
    if differences:
        return "conflict", f"{run_dir} holds a run of another config (differs in {differences})"
    if (run_dir / "final.json").is_file():
        return "done", ""
    if (run_dir / SERVER_CHECKPOINT).is_file():
        return "resume", ""
    return "new", "started before, no completed round"


LABEL_KEYS = ("method.name",)
"""Keys that name a run and change nothing it computes: Table IV's row 7 (``method.name:
t4r7_full``) is FedST's run of the same seed (``method.name: fedst``)."""


def _same_run_elsewhere(
    cfg: ExperimentConfig, run_dir: Path, seed: int
) -> tuple[Path, str, str] | None:
    """A run of ``cfg`` under another row's name beside ``run_dir`` (same seed, only
    :data:`LABEL_KEYS` differ), finished ones first: the runner reuses it instead of training the
    same run twice. None when there is none."""
    found = []
    for other in sorted(run_dir.parent.glob(f"*_s{seed}")):
        if other == run_dir or not (other / "config.json").is_file():
            continue
        try:
            saved = load_config(other)
        except (ConfigError, ValueError):
            continue
        if [k for k in learning_differences(saved, cfg) if k not in LABEL_KEYS]:
            continue
        state, _ = _run_state(saved, other)
        if state in ("done", "resume"):
            found.append((state != "done", other, state))
    if not found:
        return None
    _, other, state = min(found)
    return other, state, f"the same run as {other.name} (differs only in {', '.join(LABEL_KEYS)})"


def describe(plan: Plan) -> str:
    """The dry-run listing: one line per run with its state."""
    lines = [f"{plan.spec.name} ({plan.spec.caption}), experiment {plan.experiment}:"]
    for index, run in enumerate(plan.runs, 1):
        where = str(run.run_dir) if run.run_dir else "-"
        detail = f"  ({run.detail})" if run.detail else ""
        lines.append(
            f"  {index:3d}/{len(plan.runs)}  {run.row.name:34s} seed {run.seed}  "
            f"{run.state:11s} {where}  [{' '.join(run.overrides)}]{detail}"
        )
    counts = {s: len(plan.with_state(s)) for s in ("done", "resume", "new", "conflict")}
    counts["unavailable"] = len(plan.with_state("unavailable"))
    lines.append("  " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def execute(plan: Plan) -> list[tuple[PlannedRun, str]]:
    """Train (or resume) every run of ``plan`` that is not done; returns the failures.

    Runs of another config in the way stop everything before anything trains.
    """
    conflicts = plan.with_state("conflict")
    if conflicts:
        raise RunnerError(
            "these run directories hold runs of another config:\n"
            + "\n".join(f"  {r.detail}" for r in conflicts)
            + "\nUse another --runs folder, or delete those directories to train them again."
        )
    todo = plan.with_state("new", "resume")
    log.info(
        "%s: %d run(s) to train or resume, %d done, %d not available",
        plan.spec.name,
        len(todo),
        len(plan.with_state("done")),
        len(plan.with_state("unavailable")),
    )
    started = time.perf_counter()
    failures: list[tuple[PlannedRun, str]] = []
    for index, run in enumerate(todo, 1):
        assert run.cfg is not None and run.run_dir is not None
        setup_logging(run.run_dir)  # this run's log.txt, as train_fed.py
        log.info(
            "run %d/%d: %s seed %d (%s) in %s; elapsed %s",
            index,
            len(todo),
            run.row.name,
            run.seed,
            "resuming" if run.state == "resume" else "new",
            run.run_dir,
            _clock(time.perf_counter() - started),
        )
        try:
            run_training(
                run.cfg,
                run.run_dir,
                engine=plan.runtime.get("engine", "inprocess"),
                progress=plan.runtime.get("progress", True),
                regenerate=plan.runtime.get("regenerate", False) and index == 1,
            )
        except Exception as err:  # the other runs still train; the command exits with 1
            log.exception("run %s failed", run.run_dir)
            failures.append((run, f"{type(err).__name__}: {err}"))
            continue
        run.state = "done"
        log.info(
            "run %d/%d finished; elapsed %s",
            index,
            len(todo),
            _clock(time.perf_counter() - started),
        )
    setup_logging()
    return failures


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60:d}:{minutes % 60:02d}:{secs:02d}"


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


FPS_FILE = "fps.json"
"""In a run directory: the last FPS measurement and its settings (reused while they match)."""


def measure_fps(run_dir: Path, settings: FpsSettings = FpsSettings()) -> dict[str, Any]:
    """Frames per second of the run's personalized model of its first federated site (see
    :class:`FpsSettings`); stored in ``<run>/fps.json`` and reused while the settings and the
    run's final.json are unchanged."""
    from fedst.infer import load_site_model

    path = run_dir / FPS_FILE
    final_mtime = (run_dir / "final.json").stat().st_mtime_ns
    wanted = dataclasses.asdict(settings)
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("settings") == wanted and cached.get("final_mtime_ns") == final_mtime:
            return cached
    cfg = load_config(run_dir)
    site = cfg.data.federation[0]
    device = resolve_device(cfg.train.device)
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
            (": Dice, IoU", report.sites_table(rs, ("dice", "iou"))),
            (": HD95, ASSD", report.sites_table(rs, ("hd95", "assd"))),
            ("", report.sites_table(rs)),
        ],
        "outfed": lambda rs: [("", report.outfed_table(rs, sites=[spec.site or ""]))],
        "dice": lambda rs: [("", report.dice_table(rs, spec.name, spec.caption))],
        "efficiency": lambda rs: [("", _efficiency_table(rs, plan, fps))],
        "curves": lambda rs: [
            (f": {panel}" if panel else "", table)
            for panel, table in report.curve_tables(results.group_by_method(rs))
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
    tables = [table for _, table in built]
    markdown, csv_table = (tables[:-1], tables[-1]) if len(tables) > 1 else (tables, tables[0])
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
    return report.paired_dice_table(
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
    columns, values = report.comm_columns()
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
        f"* Communication: parameter values (fp32) per site and round; {report.SIZE_NOTE}.",
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
    return [plots.plot_learning_curves(report.curve_series(grouped), png, colors=colors)]


def _plot_pairs(table: results.Table, png: Path) -> Path:
    """Fig. 7's layout: a panel per site (federated, Avg., out of federation), the methods along
    x, a lighter bar without and a darker bar with synthetic data."""
    without, with_synthetic = report.PAIR_VARIANTS
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


# -- CLI ------------------------------------------------------------------------------------------


DEFAULT_RUNS = Path("runs")


def tables_root(runs: Path) -> Path:
    """Where the tables go without ``--out``: ``results`` for the default runs root, otherwise
    ``<runs>/results``, so that tables of another set of runs (``--runs runs/fp16``) never
    overwrite the default runs' ``results/<experiment>/<table>.md``."""
    return Path("results") if runs == DEFAULT_RUNS else runs / "results"


def main(argv: Sequence[str] | None = None) -> int:
    tokens = list(sys.argv[1:] if argv is None else argv)
    key_values = [t for t in tokens if "=" in t and not t.startswith("-")]  # anywhere on the line
    parser = argparse.ArgumentParser(
        prog="python -m fedst.experiments",
        usage="%(prog)s TABLE [--dry-run] [--runs DIR] [--out DIR] [--fps-*] [seeds=0,1,2] "
        "[rows=NAME,NAME] [Hydra overrides]",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Tables: " + ", ".join(f"{n} ({s.caption})" for n, s in TABLES.items()),
    )
    parser.add_argument("table", choices=list(TABLES))
    parser.add_argument("--dry-run", action="store_true", help="list the runs; train nothing")
    parser.add_argument("--runs", type=Path, default=DEFAULT_RUNS, help="root of run directories")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="root of the tables (default: results, or <runs>/results with another --runs)",
    )
    parser.add_argument("--fps-frames", type=int, default=FpsSettings.frames)
    parser.add_argument("--fps-warmup", type=int, default=FpsSettings.warmup)
    parser.add_argument("--fps-threads", type=int, default=FpsSettings.threads)
    setup_logging()
    try:
        seeds, rows, overrides = parse_arguments(key_values)
    except RunnerError as err:
        log.error("%s", err)
        return 2
    parser.set_defaults(seeds=seeds, rows=rows, overrides=overrides)
    options = parser.parse_args([t for t in tokens if t not in key_values])
    try:
        plan = plan_table(TABLES[options.table], seeds, overrides, options.runs, rows)
        print(describe(plan))
        if options.dry_run:
            return 0
        failures = execute(plan)
        fps = FpsSettings(options.fps_frames, options.fps_warmup, options.fps_threads)
        markdown, csv_table = build_tables(plan, failures, fps)
        written = write_outputs(plan, markdown, csv_table, options.out or tables_root(options.runs))
    except (RunnerError, ConfigError) as err:
        log.error("%s", err)
        return 2
    print()
    print("\n".join(t.to_markdown() for t in markdown))
    for path in written:
        print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
