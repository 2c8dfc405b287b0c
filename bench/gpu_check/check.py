"""The GPU check's driver (``python -m bench.gpu_check``): the device facts, the pre-flight, the
steps of bench/gpu_check/plan.py run in order within the budget, and the report
(``gpu_check.md`` / ``.json`` / ``.log``). The whole check is described in
bench/gpu_check/__init__.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.environment import child_environment
from bench.gpu_check import schedule
from bench.gpu_check.plan import CPU_SIZES, GPU_SIZES, plan_steps
from bench.gpu_check.runner import StepResult, run_step
from bench.gpu_check.timing import bench_step, bench_stream, write_json
from bench.gpu_check.wheels import make_wheels, requirement_report
from bench.scratch import scratch_dir

REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger("gpu_check")

# -- device facts -------------------------------------------------------------------------------


def device_facts(device_name: str) -> dict[str, object]:
    """Python, torch, CUDA, the card, its bf16 support, TF32 flags as the runs set them, the
    packages that matter here and ONNX Runtime's providers."""
    from importlib import metadata

    import torch

    from fedst import accel

    device = torch.device(device_name)
    facts: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": str(device),
        "card": accel.device_name(device),
        "cpu_cores": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        accel.configure_device(device, tf32=True, cudnn_benchmark=True)
        facts |= {
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_gib": props.total_memory / 1024**3,
            "bf16_supported": torch.cuda.is_bf16_supported(),
            "cudnn": torch.backends.cudnn.version(),
            "tf32_after_configure_device": {
                "matmul_fp32_precision": torch.backends.cuda.matmul.fp32_precision,
                "conv_fp32_precision": torch.backends.cudnn.conv.fp32_precision,
            },
        }
        smi = shutil.which("nvidia-smi")
        if smi:
            query = [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"]
            facts["nvidia_smi"] = subprocess.run(
                query, capture_output=True, text=True, check=False
            ).stdout.strip()
    versions = {}
    for name in ("flwr", "monai", "hydra-core", "timm", "numpy", "protobuf", "onnxruntime"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    facts["packages"] = versions
    started = time.perf_counter()  # a fresh machine builds matplotlib's font cache once (~17 s
    import matplotlib.font_manager  # noqa: F401  on the H200): here, not inside a timed step

    facts["matplotlib_import_s"] = round(time.perf_counter() - started, 1)
    import importlib.util

    facts["imported_from"] = {  # where each comes from: /tmp/site's wheels, or the machine's own
        name: str(Path(spec.origin).parent.parent)
        for name in ("torch", "numpy", "flwr", "hydra", "monai")
        if (spec := importlib.util.find_spec(name)) is not None and spec.origin
    }
    try:
        import onnxruntime

        facts["onnxruntime_providers"] = onnxruntime.get_available_providers()
    except ImportError:
        facts["onnxruntime_providers"] = []
    return facts


def preflight(device_name: str) -> str | None:
    """Why the check cannot run on ``device_name`` (None: it can): on "cuda", a torch that sees
    no GPU (fedst.accel.cuda_unavailable_reason: a CPU-only build, hidden GPUs, a driver too
    old) or that cannot run one kernel on it. Seconds, before any wheel is installed."""
    import torch

    from fedst.accel import cuda_unavailable_reason

    if device_name != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no GPU: {cuda_unavailable_reason()}"
    try:
        value = (torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")).sum()
        if float(value) != 64.0**3:
            return f"a 64x64 matrix product on {torch.cuda.get_device_name()} gave {float(value)}"
    except RuntimeError as err:
        return f"torch {torch.__version__} cannot run a kernel on the GPU: {err}"
    return None


def write_report(out: Path, header: dict, results: list[StepResult]) -> None:
    """gpu_check.json (everything) and gpu_check.md (a table and each step's figures)."""
    payload = {**header, "steps": [dataclasses.asdict(r) for r in results]}
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=1, default=str))
    lines = [
        f"# GPU check: {header['mode']}",
        "",
        f"{header['started']}, {header['host']}; card: {header.get('card', 'not yet known')}; "
        f"budget {header['budget_s']:.0f} s, elapsed {header['elapsed_s']:.0f} s",
        "",
        "The paper's figures for comparison: 43.8 h for its whole training on one RTX A5000, "
        "23 FPS at inference (Sec. IV). Requirement report of this python (pip_list.txt, "
        f"requirements.txt): {header.get('requirements', 'not written')}",
        "",
        "| step | status | s | GPU util % (mean) | GPU mem MiB (max) | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        util = r.gpu.get("utilization_mean_pct")
        used = r.gpu.get("memory_used_max_mib")
        lines.append(
            f"| {r.name} | {r.status} | {r.seconds:.0f} | "
            f"{'-' if util is None else f'{util:.0f}'} | {'-' if used is None else f'{used:.0f}'} "
            f"| {r.note.replace('|', '/')} |"
        )
    for r in results:
        if r.metrics or r.commands:
            lines += ["", f"## {r.name}: {r.title}", ""]
            if r.measures:
                lines += [f"What it measures: {r.measures}.", ""]
            lines += [f"    {command}" for command in r.commands] + [""]
            lines += _metrics_markdown(r.metrics)
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def _number(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _metrics_markdown(metrics: dict) -> list[str]:
    """A step's figures: a table of its variants (step, stream), the schedule's table, else one
    line per figure."""
    if "round_iters" in metrics:  # the schedule step
        return schedule.markdown(metrics)
    variants = metrics.get("variants")
    if isinstance(variants, dict):
        lines = [
            "| variant | status | ms (p50) | ms p95 | FPS (p50) | speed-up vs baseline "
            "| peak GiB | max abs diff vs eager fp32 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, v in variants.items():
            ms = v.get("ms_per_step", v.get("ms_p50"))
            cells = [
                ms,
                v.get("ms_p95"),
                v.get("fps"),
                v.get("speedup_vs_baseline"),
                v.get("peak_allocated_gib"),
                v.get("max_abs_diff_vs_eager_fp32"),
            ]
            lines.append(
                f"| {name} | {v.get('status', '').replace('|', '/')[:200]} | "
                + " | ".join("-" if c is None else _number(c) for c in cells)
                + " |"
            )
        rest = {k: v for k, v in metrics.items() if k != "variants"}
        return [*lines, "", *(f"* {k}: {_number(v)}" for k, v in rest.items())]
    lines = []
    for key, value in metrics.items():
        if isinstance(value, dict):
            inner = ", ".join(f"{k} {_number(v)}" for k, v in value.items())
            lines.append(f"* {key}: {inner}")
        elif key != "command":
            lines.append(f"* {key}: {_number(value)}")
    return lines


def run_check(
    cpu: bool, out: Path, budget_s: float | None, keep_work: Path | None = None
) -> list[StepResult]:
    """Every step in order within the overall budget; the report is rewritten after each.

    The steps' files (runs, generated data: about 1.7 GB on the CPU) go to ``keep_work`` when it
    is given, else to a temporary directory removed at the end (bench/scratch.py).
    """
    with scratch_dir("fedst_gpu_check_", keep_work) as work:
        return _run_steps(cpu, out, budget_s, work, removed=keep_work is None)


def _run_steps(
    cpu: bool, out: Path, budget_s: float | None, work: Path, removed: bool
) -> list[StepResult]:
    out.mkdir(parents=True, exist_ok=True)
    sizes = CPU_SIZES if cpu else GPU_SIZES
    budget = budget_s if budget_s is not None else sizes.budget_s
    device = "cpu" if cpu else "cuda"
    steps = plan_steps(device, sizes, work)
    env = {**child_environment(), "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    header = {
        "mode": "cpu (reduced sizes)" if cpu else "gpu",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "budget_s": budget,
        "elapsed_s": 0.0,
        "work_dir": f"{work} (removed at the end)" if removed else str(work),
    }
    requirements = out / "requirements.txt"
    if requirements.is_file():  # written by gpu_check.sh before the steps
        unmet = [line for line in requirements.read_text().splitlines() if line.strip()]
        header["requirements"] = (
            "every requirement met" if not unmet else f"{len(unmet)} lines, see requirements.txt"
        )
    results: list[StepResult] = []
    with open(out / "gpu_check.log", "a") as logfile:
        for step in steps:
            left = budget - (time.monotonic() - started)
            log.info("step %s (%.0f s left)", step.name, left)
            limit = min(step.timeout_s * sizes.timeout_scale, left)
            result = run_step(step, env, limit, not cpu, logfile)
            log.info(
                "step %s: %s in %.0f s %s", step.name, result.status, result.seconds, result.note
            )
            results.append(result)
            if step.name == "facts" and result.metrics.get("card"):
                header["card"] = result.metrics["card"]
            header["elapsed_s"] = time.monotonic() - started
            write_report(out, header, results)
    return results


def failed_steps(results: list[StepResult]) -> list[str]:
    """The steps that did not end "ok" (failed, timeout, not run, unsupported): any makes the
    check exit non-zero, so a lost figure is never a silent success."""
    return [f"{r.name} ({r.status})" for r in results if r.status != "ok"]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_check",
        description="The prepared GPU check of FedST (bench/gpu_check/__init__.py).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("wheels", help="fill .whl/ with the wheels the GPU machine lacks")
    check = sub.add_parser("run", help="every step; the report in --out")
    check.add_argument("--cpu", action="store_true", help="on the CPU at a reduced size")
    check.add_argument("--out", type=Path, default=REPO / "gpu_check_out")
    check.add_argument("--budget-s", type=float, default=None, help="overall time budget")
    check.add_argument(
        "--keep-work", type=Path, default=None,
        help="keep the steps' runs and data here (default: a temporary directory, removed)",
    )  # fmt: skip
    facts = sub.add_parser("facts")
    facts.add_argument("--device", default="cuda")
    facts.add_argument("--json", type=Path, required=True)
    flight = sub.add_parser("preflight", help="exit 3 with the reason when the device is unusable")
    flight.add_argument("--device", default="cuda")
    sub.add_parser("requirements", help="print the installed packages' unmet requirements")
    for name in ("step", "stream"):
        bench = sub.add_parser(name)
        bench.add_argument("--device", default="cuda")
        bench.add_argument("--size", type=int, nargs=2, default=(512, 640))
        bench.add_argument("--iters", type=int, default=5)
        bench.add_argument("--repeats", type=int, default=3)
        bench.add_argument("--frames", type=int, default=40)
        bench.add_argument("--budget-s", type=float, default=80)
        bench.add_argument("--compile-backend", default="inductor")
        bench.add_argument("--json", type=Path, required=True)
    schedule.add_arguments(sub.add_parser("schedule", help="the paper's schedule, measured"))
    args = parser.parse_args(argv)
    if args.command == "wheels":
        make_wheels()
    elif args.command == "run":
        results = run_check(args.cpu, args.out, args.budget_s, args.keep_work)
        bad = failed_steps(results)
        print(f"report: {args.out / 'gpu_check.md'}; not ok: {', '.join(bad) or 'none'}")
        return 1 if bad else 0
    elif args.command == "preflight":
        reason = preflight(args.device)
        if reason is not None:
            print(f"gpu_check: no usable {args.device} device: {reason}", file=sys.stderr)
            return 3
    elif args.command == "requirements":
        print("\n".join(requirement_report()))
    elif args.command == "facts":
        write_json(args.json, device_facts(args.device))
    elif args.command == "schedule":
        schedule.run(args)
    elif args.command == "step":
        bench_step(
            args.device,
            tuple(args.size),
            args.iters,
            args.repeats,
            args.budget_s,
            args.compile_backend,
            args.json,
        )
    elif args.command == "stream":
        bench_stream(
            args.device,
            tuple(args.size),
            args.frames,
            args.budget_s,
            args.compile_backend,
            args.json,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
