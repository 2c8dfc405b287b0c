"""`make demo`: the whole pipeline on the embedded procedural benchmark, on a laptop CPU.

1. generate the benchmark (data/procedural/demo_v2, generator version 2) and its preview sheets,
   unless already there;
2. train FedST and FedAvg with configs/experiment/demo.yaml for its first ``--rounds`` rounds
   (default 8 of its 20: the laptop budget, 15 minutes on 2 cores; ``--rounds 20`` is the whole
   protocol of studies/demo_protocol/README.md), resuming an interrupted run and skipping a finished one;
3. evaluate out of federation (site E, GraSP) with the same code as eval_outfed.py;
4. print one comparison table (sites A-D and their mean, E, GraSP; Dice and IoU) and the plots.

    python -m fedst.demo [--runs runs/demo] [--methods fedst,fedavg] [--seed 0] [--rounds 8] [override ...]
Extra arguments are Hydra overrides applied to every method, e.g. `train.local_iters=10`.

Why 8 rounds. The protocol's 20 rounds took 1696 s on this project's 2-core AMD EPYC (README),
against the demo's budget of 900 s. The demo's configuration is the protocol's but for
``train.total_iters`` (and the rounds it gives): the learning rate is constant and nothing else in
FedST or FedAvg depends on the number of rounds, so the demo trains as the protocol's first 8
rounds (checked: every site's loss in rounds 1-8 equals that of the protocol's seed-0 runs to
2e-7 relative, float rounding of 2 threads against 1). An explicit ``train.total_iters=...``
override wins over ``--rounds``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from fedst.cli import compose_experiment, setup_logging
from fedst.data.preview import write_previews
from fedst.errors import ArgumentParser
from fedst.experiment import ExperimentConfig, Runtime
from fedst.report import plots, results, tables
from fedst.runs import Run
from fedst.runs.files import load_config, unfinished
from fedst.training import finalize_run, prepare_benchmark, run_training

log = logging.getLogger("fedst.demo")

DEMO_ROUNDS = 8
"""Rounds `make demo` trains: the first 8 of configs/experiment/demo.yaml's 20 (module docstring)."""


def demo_config(
    method: str | None, seed: int, rounds: int, overrides: list[str]
) -> tuple[ExperimentConfig, Runtime]:
    """(config, runtime options) of one demo run: ``experiment=demo`` with ``method`` (None: the
    experiment's default), ``seed`` and ``rounds`` rounds, then the user's ``overrides``."""
    local_iters = compose_experiment(["experiment=demo", *overrides])[0].train.local_iters
    choices = [f"method={method}"] if method else []
    return compose_experiment(
        [
            "experiment=demo",
            *choices,
            f"seed={seed}",
            f"train.total_iters={rounds * local_iters}",
            *overrides,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runs", type=Path, default=Path("runs/demo"), help="where the run directories go"
    )
    parser.add_argument(
        "--methods", default="fedst,fedavg", help="comma-separated configs/method names"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEMO_ROUNDS,
        help=f"communication rounds of train.local_iters each (default {DEMO_ROUNDS}; "
        "the protocol of studies/demo_protocol: 20)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every method")
    args = parser.parse_args(argv)
    setup_logging()
    started = time.perf_counter()

    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: train at least 1 round")
    cfg, _ = demo_config(None, args.seed, args.rounds, args.overrides)
    # every method's config is checked (a ConfigError names the mistake) before anything is written
    planned = {
        m: demo_config(m, args.seed, args.rounds, args.overrides) for m in args.methods.split(",")
    }
    benchmark = prepare_benchmark(cfg, progress=True)
    data_root = Path(benchmark["root"])
    log.info("benchmark: %s (generator version %d)", data_root, benchmark["generator_version"])
    previews = write_previews(data_root)

    run_dirs = []
    for method, (cfg, runtime) in planned.items():
        run_dir = args.runs / f"{method}_s{args.seed}_{args.rounds}rounds"
        if unfinished(run_dir) is None and load_config(run_dir) == cfg:
            log.info("%s: finished run found in %s; refreshing its evaluation", method, run_dir)
            finalize_run(Run(run_dir, cfg))
        else:
            log.info("%s: training in %s", method, run_dir)
            run_training(cfg, run_dir, progress=runtime.progress)
        run_dirs.append(run_dir)

    runs = results.load_runs(run_dirs)
    table = tables.comparison_table(runs)
    out = args.runs / "comparison"
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.md").write_text(table.to_markdown() + "\n")
    table.to_csv(out / "comparison.csv")
    comparison_png = plots.plot_comparison(runs, out / "comparison_dice.png")
    curves_png = plots.plot_learning_curves(
        {run["method"]: run["metrics"] for run in runs},
        out / "learning_curves.png",
    )
    print()
    print(table.to_markdown())
    print()
    print(f"plots: {comparison_png}  {curves_png}")
    for run_dir in run_dirs:
        print(f"       {run_dir / 'plots'}/{{learning_curves,communication,qualitative}}.png")
    print(f"benchmark preview: {previews[0].parent}")
    print(f"demo finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    from fedst.errors import run_entry_point

    run_entry_point(main, "python -m fedst.demo")
