"""The runs a table needs, each with its state (done, resume, new, conflict, unavailable), and
their training through the same entry as train_fed.py (:func:`execute`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedst.cli import CONFIG_DIR, compose_experiment, learning_differences, setup_logging
from fedst.config import ConfigError
from fedst.experiment import ExperimentConfig, Runtime
from fedst.paper.tables import DEFAULT_SEEDS, REFUSED_KEYS, Row, RunnerError, TableSpec
from fedst.runs.files import load_config, unfinished
from fedst.runs.layout import CONFIG_JSON, SERVER_CHECKPOINT

log = logging.getLogger("fedst.paper")

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
    runtime: Runtime = field(default_factory=Runtime)

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
    if not (run_dir / CONFIG_JSON).is_file():
        return "new", ""
    try:
        saved = load_config(run_dir)
    except (ConfigError, ValueError) as err:
        return "conflict", f"{run_dir / CONFIG_JSON} cannot be read ({err})"
    differences = learning_differences(saved, cfg)
    if differences:
        return "conflict", f"{run_dir} holds a run of another config (differs in {differences})"
    if unfinished(run_dir) is None:  # the end of its training wrote final.json
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
        if other == run_dir or not (other / CONFIG_JSON).is_file():
            continue
        try:
            saved = load_config(other)
        except (ConfigError, ValueError):
            continue
        if [k for k in learning_differences(saved, cfg) if k not in LABEL_KEYS]:
            continue
        if unfinished(other) is None:
            found.append((False, other, "done"))
        elif (other / SERVER_CHECKPOINT).is_file():
            found.append((True, other, "resume"))
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
    from fedst.training import run_training  # torch and the stack: only when a run trains

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
                engine=plan.runtime.engine,
                progress=plan.runtime.progress,
                regenerate=plan.runtime.regenerate and index == 1,
                ray=plan.runtime.ray,
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
