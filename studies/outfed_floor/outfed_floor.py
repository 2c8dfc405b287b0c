"""Why does site E sit at the floor? The diagnosis table of issue 15: E Dice / IoU per configuration.

    .venv/bin/python -m studies.outfed_floor.outfed_floor --out runs/outfed_floor --dry-run   # the plan, commands
    .venv/bin/python -m studies.outfed_floor.outfed_floor --out runs/outfed_floor             # run it (hours)
    .venv/bin/python -m studies.outfed_floor.outfed_floor --out /tmp/floor_smoke --smoke      # tiny preset, minutes
    .venv/bin/python -m studies.outfed_floor.outfed_floor --out runs/outfed_floor data=demo_v1   # generator v1

Every row is one ``train_fed.py`` run with overrides in its own run directory ``<out>/<row>``; a row
whose final.json exists is read back instead of run (an interrupted one is resumed from its last
round), so the script can be stopped and restarted. Rows, all on the demo benchmark at seed 0:

* ``oracle``: the Local network (method=local) trained on E-like *training* videos alone, scored
  on E's test split like every other row: the ceiling of E. The script writes them first, as
  ``python -m fedst.data.procedural --out data/procedural/demo_v2_oracle --oracle-split E`` does
  (``<data.root>_oracle``, never a benchmark folder, same generator version);
* ``upperbound`` (pooled A-D; only when configs/method/upperbound.yaml exists), ``fedavg`` and
  ``fedst``, each at 1x, 4x and 16x the demo's local iterations (``--budgets``; evaluation every
  k x ``train.eval_every`` rounds, so every run has as many learning-curve points);
* the same methods with photometric augmentation (:data:`PHOTOMETRIC`: brightness, contrast,
  saturation and hue jitter and a Gaussian blur, fedst/data/clips/augmentation.py) at ``--variant-budgets``;
* the same methods without the synthetic pre-training (``pretraining.iters=0``: every method
  starts from the initialisation; FedST keeps SERQ) at ``--variant-budgets``.

Prints and writes ``<out>/outfed_floor.md`` and ``.json``: per row E Dice / IoU, the in-federation
mean Dice, GraSP Dice, the wall time of the run (measured here, with the load average before it)
and the command. Runs are sequential by default (``--jobs 2`` runs two single-threaded runs at once
on 2 cores; wall times then include the contention).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.environment import REPO, child_environment
from fedst.cli import compose_experiment
from fedst.data.procedural import generate_oracle_split, oracle_site_name
from fedst.training import BENCHMARK_SEED

PHOTOMETRIC = ("augment.color_jitter=0.4", "augment.hue=0.1", "augment.blur_sigma=1.0")
"""Photometric augmentation of the 'on' rows: brightness / contrast / saturation jitter 0.4 (the
issue's data point), hue shift up to 0.1 of the circle, blur sigma up to 1 px at the input size."""
NO_PRETRAINING = ("pretraining.iters=0",)
ORACLE_OF = "E"
ROW_RECORD = "floor_row.json"
"""Written into each row's run directory: command, wall seconds, load average, exit code."""


@dataclass(frozen=True)
class Row:
    name: str
    method: str
    budget: int
    photometric: bool = False
    pretraining: bool = True
    overrides: tuple[str, ...] = field(default=())


def plan(
    methods: Sequence[str],
    budgets: Sequence[int],
    variant_budgets: Sequence[int],
    base_overrides: Sequence[str],
    base_iters: int,
    base_eval_every: int,
    oracle_overrides: Sequence[str],
) -> list[Row]:
    """The rows: every method at every budget, then the photometric and no-pre-training variants."""

    def row(method: str, k: int, photometric: bool = False, pretraining: bool = True) -> Row:
        name = f"{method}_x{k}" + ("_photometric" if photometric else "")
        name += "" if pretraining else "_nopretrain"
        method_overrides = oracle_overrides if method == "oracle" else (f"method={method}",)
        overrides = (
            *base_overrides,
            *method_overrides,
            f"train.total_iters={k * base_iters}",
            f"train.eval_every={k * base_eval_every}",
            *(PHOTOMETRIC if photometric else ()),
            *(() if pretraining else NO_PRETRAINING),
        )
        return Row(name, method, k, photometric, pretraining, overrides)

    rows = [row(m, k) for m in methods for k in budgets]
    rows += [row(m, k, photometric=True) for m in methods for k in variant_budgets]
    rows += [row(m, k, pretraining=False) for m in methods for k in variant_budgets]
    return rows


def command_of(row: Row, run_dir: Path) -> list[str]:
    if (run_dir / "checkpoints" / "server.pt").is_file():
        return [sys.executable, "train_fed.py", f"resume={run_dir}", "progress=false"]
    return [
        sys.executable,
        "train_fed.py",
        *row.overrides,
        f"hydra.run.dir={run_dir}",
        "progress=false",
    ]


def run_row(row: Row, run_dir: Path) -> dict:
    """Run (or resume) one row unless its final.json exists; returns its record."""
    record_path = run_dir / ROW_RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"seconds": 0.0}
    if (run_dir / "final.json").is_file():
        return record | {"skipped": True}
    command = command_of(row, run_dir)
    env = {**child_environment(), "OMP_NUM_THREADS": "1"}
    load = os.getloadavg()[0]
    print(f"[{row.name}] {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    with (run_dir.parent / f"{row.name}.log").open("a") as log:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=log, check=False)
    seconds = time.perf_counter() - started
    record = {
        "command": shlex.join(command) if "command" not in record else record["command"],
        "seconds": record["seconds"] + seconds,
        "load_average_before": load,
        "returncode": done.returncode,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ROW_RECORD).write_text(json.dumps(record, indent=2))
    if done.returncode != 0:
        print(f"[{row.name}] FAILED (exit {done.returncode}): see {log.name}", flush=True)
    return record


def table_row(row: Row, run_dir: Path, record: dict) -> dict:
    final_path = run_dir / "final.json"
    final = json.loads(final_path.read_text()) if final_path.is_file() else {}
    outfed = final.get("out_of_federation", {})
    sites = final.get("sites", {})
    in_fed = [v["dice"] for v in sites.values() if v.get("dice") is not None]
    return {
        "row": row.name,
        "method": row.method,
        "budget": f"{row.budget}x",
        "photometric": row.photometric,
        "pretraining": row.pretraining,
        "E_dice": outfed.get("E", {}).get("dice"),
        "E_iou": outfed.get("E", {}).get("iou"),
        "in_federation_dice": sum(in_fed) / len(in_fed) if in_fed else None,
        "grasp_dice": outfed.get("grasp", {}).get("dice"),
        "seconds": record.get("seconds"),
        "load_average_before": record.get("load_average_before"),
        "command": record.get("command") or shlex.join(command_of(row, run_dir)),
        "finished": bool(final),
    }


def markdown(rows: list[dict]) -> str:
    def number(value: float | None, digits: int = 1) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    lines = [
        "| row | E Dice | E IoU | in-fed Dice | GraSP Dice | wall (min) | load | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        minutes = None if r["seconds"] is None else r["seconds"] / 60
        lines.append(
            f"| {r['row']} | {number(r['E_dice'])} | {number(r['E_iou'])} | "
            f"{number(r['in_federation_dice'])} | {number(r['grasp_dice'])} | {number(minutes)} | "
            f"{number(r['load_average_before'])} | `{r['command']}` |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="root of the rows' run directories")
    parser.add_argument("--smoke", action="store_true", help="tiny preset, 1x only (plumbing test)")
    parser.add_argument(
        "--budgets", default=None, help="multiples of the demo's iterations: 1,4,16"
    )
    parser.add_argument(
        "--variant-budgets",
        default=None,
        help="budgets of the photometric / no-pretraining rows: 1,4",
    )
    parser.add_argument("--seed", type=int, default=0, help="training seed of every row")
    parser.add_argument("--only", default=None, help="comma-separated row names to run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each one thread)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and commands only")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides for every row, e.g. data=demo_v1 (the benchmark before issue 15)",
    )
    args = parser.parse_args(argv)

    experiment = "tiny" if args.smoke else "demo"
    base = (f"experiment={experiment}", f"seed={args.seed}", *args.overrides)
    cfg, _ = compose_experiment(list(base))
    budgets = _ints(args.budgets, "1" if args.smoke else "1,4,16")
    variant_budgets = _ints(args.variant_budgets, "1" if args.smoke else "1,4")
    args.out = args.out.resolve()
    oracle_root = (REPO / f"{cfg.data.root}_oracle").resolve()  # train_fed.py runs in REPO
    oracle = oracle_site_name(ORACLE_OF)
    surgery = cfg.data.sites[ORACLE_OF].surgery_type
    oracle_overrides = (
        "method=local",
        f"data.federation=[{oracle}]",
        f"+data.sites.{oracle}={{backend:generic,root:{oracle_root},surgery_type:{surgery}}}",
    )
    methods = ["oracle"]
    if (REPO / "configs" / "method" / "upperbound.yaml").is_file():
        methods.append("upperbound")
    else:
        print("note: configs/method/upperbound.yaml is absent: the upper-bound rows are skipped")
    methods += ["fedavg", "fedst"]
    rows = plan(
        methods,
        budgets,
        variant_budgets,
        base,
        cfg.train.total_iters,
        cfg.train.eval_every,
        oracle_overrides,
    )
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {r.name for r in rows}
        if unknown:
            parser.error(f"--only {sorted(unknown)}: not rows of the plan {[r.name for r in rows]}")
        rows = [r for r in rows if r.name in wanted]
    if args.dry_run:
        for row in rows:
            print(f"{row.name}: {shlex.join(command_of(row, args.out / row.name)[1:])}")
        return 0

    if any(r.method == "oracle" for r in rows):
        generate_oracle_split(
            oracle_root,
            BENCHMARK_SEED,
            str(cfg.data.procedural),
            ORACLE_OF,
            progress=False,
            version=cfg.data.generator_version,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        records = list(pool.map(lambda r: run_row(r, args.out / r.name), rows))
    table = [table_row(r, args.out / r.name, rec) for r, rec in zip(rows, records, strict=True)]
    text = markdown(table)
    (args.out / "outfed_floor.md").write_text(text)
    (args.out / "outfed_floor.json").write_text(json.dumps(table, indent=2))
    print(text)
    print(f"written: {args.out / 'outfed_floor.md'} and {args.out / 'outfed_floor.json'}")
    return 0 if all(r["finished"] for r in table) else 1


def _ints(value: str | None, default: str) -> list[int]:
    return [int(v) for v in (value or default).split(",") if v]


if __name__ == "__main__":
    raise SystemExit(main())
