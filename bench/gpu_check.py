"""The prepared GPU check (issue 33, item 9): every GPU-relevant check of FedST in one command, on
a borrowed machine with one H100 (or H200), 16 cores, no network and a ``python3`` that already
holds torch 2.11, timm, onnx, onnxruntime, OpenCV, matplotlib, TensorBoard and pytest.

    make gpu-wheels                 # here: the wheels that machine lacks, into .whl/ (git-ignored)
    bash bench/gpu_check.sh         # there, from the repository root: report in $OUT or gpu_check_out/
    bash bench/gpu_check.sh --cpu   # anywhere: the same steps on the CPU at a reduced size

Steps, in this order, each with its own time limit inside one overall budget (``--budget-s``,
460 s on a GPU): ``facts`` (torch, CUDA, card, dtype, TF32, package versions); ``federation`` (a
tiny federation on the device with ``train_fed.py``, then ``eval_outfed.py`` and ``fedst.infer``,
checking that the device was really used); ``paper_scale`` (``bench.paper_scale --tiny-data`` at
512x640 with paper.yaml's settings: ms per site step, GPU busy fraction, SERQ's, the loader
wait's and the evaluation's shares, peak memory, the paper's run in hours); ``step`` (one training
step of the network, batch 2 of 4-frame clips at 512x640, with none of the options against TF32,
bf16, channels_last and torch.compile, in one process, so the ratios come from one run);
``stream`` (streaming inference FPS at 512x640: eager fp32, bf16 and fp16 autocast, compiled, and
ONNX Runtime with its CUDA provider where present); ``tests`` (the CUDA-relevant test files with
``FEDST_TEST_DEVICE=cuda``); with ``--cpu`` only (they do not fit the GPU lease, see
``GPU_SIZES``): ``paper_scale_baseline`` (fp32, no TF32, no compile, no channels_last) and
``paper_scale_options`` (``train.compile`` and ``train.channels_last`` on).

The wheels and the machine's packages are bench/gpu_wheels.py; the ``step`` and ``stream``
timings bench/gpu_timing.py; running one step (its time limit, its process group, nvidia-smi
sampled meanwhile) bench/check_runner.py; this module holds the facts, the steps and the report.

After every step ``gpu_check.md`` and ``gpu_check.json`` are rewritten and every command's output
is appended to ``gpu_check.log``, so a run cut off at any point still returns what it measured.
A step whose override names a config field this checkout does not have is ``unsupported``.

``--cpu`` runs the same steps on the CPU: 64x80 instead of 512x640, 1 round of 1 iteration, a
few timed iterations, torch.compile with the ``eager`` backend (dynamo's tracing without
inductor's C++ build, which takes minutes on 2 cores) and only test_devices.py and this check's
own device tests, so tests/test_gpu_check.py can run the script in CI-sized time.
"""

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
from dataclasses import dataclass
from pathlib import Path

from bench.check_runner import CheckFailed, Step, StepResult, run_step
from bench.environment import child_environment
from bench.gpu_timing import bench_step, bench_stream, write_json
from bench.gpu_wheels import make_wheels, requirement_report
from bench.scratch import scratch_dir

REPO = Path(__file__).resolve().parents[1]
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


# -- federation: the device was really used -----------------------------------------------------


def check_federation(run_dir: Path, infer_dir: Path, device: str) -> dict:
    """Evidence that a finished tiny federation ran on ``device``: its config.json asks for it,
    and on CUDA its train.jsonl reports CUDA memory (a ``cuda`` / ``gpu`` key > 0);
    eval_outfed.py wrote its out-of-federation scores and fedst.infer its summary. Raises
    :class:`CheckFailed`."""
    config = json.loads((run_dir / "config.json").read_text())
    requested = config["train"]["device"]
    if requested != device:
        raise CheckFailed(f"{run_dir}/config.json: train.device={requested!r}, not {device!r}")
    rows = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines()]
    cuda_bytes = max(
        (
            v
            for row in rows
            for k, v in row.items()
            if ("cuda" in k or "gpu" in k) and isinstance(v, int | float)
        ),
        default=0,
    )
    if device == "cuda" and not cuda_bytes > 0:
        raise CheckFailed(f"{run_dir}/train.jsonl: no CUDA memory reported (a CPU run?)")
    final = json.loads((run_dir / "final.json").read_text())
    if not final.get("out_of_federation"):
        raise CheckFailed(f"{run_dir}/final.json: eval_outfed.py wrote no out_of_federation")
    summary = json.loads((infer_dir / "summary.json").read_text())
    if summary["frames"] < 1:
        raise CheckFailed(f"{infer_dir}/summary.json: fedst.infer streamed no frame")
    return {
        "train.device": requested,
        "max_cuda_bytes_in_train_jsonl": cuda_bytes,
        "rounds": max(r.get("round", 0) for r in rows),
        "infer_frames": summary["frames"],
        "infer_fps_network_mean": summary["fps_network_mean"],
    }


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _config_fields() -> dict[str, object]:
    """TrainConfig's fields of this checkout and their defaults (what an override may name)."""
    from fedst.experiment.config import TrainConfig

    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def _compile_override(fields: dict, mode: str | None) -> str:
    """``train.compile`` for ``mode`` (None: off) in this checkout's form: a mode string, or a
    bool where the field is still one."""
    if isinstance(fields.get("compile"), bool):
        return f"train.compile={'false' if mode is None else 'true'}"
    return f"train.compile={'none' if mode is None else mode}"


@dataclass(frozen=True)
class Sizes:
    """The reduced (``--cpu``) or full (GPU) sizes of every step."""

    image: tuple[int, int]
    rounds: int
    """paper_scale's rounds: the first warms up, the ones that neither evaluate nor save a
    checkpoint give the busy fraction (bench/paper_scale.py, training_rounds)."""
    local_iters: int
    """Site iterations per paper_scale round (the paper's 100: enough that per-round host work
    is amortised as there)."""
    eval_every: int
    """paper_scale evaluates at this round (a non-last evaluation: the cost per frame) and at
    the last."""
    pretrain_iters: int
    """Synthetic pre-training steps; the first 2 are warm-up, not timed."""
    eval_frames: int
    step_iters: int
    step_repeats: int
    stream_frames: int
    scoring_repeats: int
    compile_backend: str
    budget_s: float
    options_rounds: int | None
    options_local_iters: int
    """The baseline and options runs of paper_scale: only their ms per site step is compared.
    None: not run (on the GPU; see ``GPU_SIZES``)."""
    federation: tuple[str, ...] = ()
    """Overrides of the tiny federation (beyond experiment=tiny)."""
    outfed_frames: int | None = None
    """eval_outfed.py's max_frames (None: all)."""
    timeout_scale: float = 1.0
    """Every step's time limit is multiplied by this (a loaded 2-core CPU is slow to start)."""


GPU_TEST_FILES = (
    "tests/test_gpu_check.py::test_a_training_step_on_the_test_device_gives_the_cpu_s_loss_and_gradients",
    "tests/test_gpu_check.py::test_streaming_on_the_test_device_gives_the_cpu_s_logits",
    "tests/test_device_scoring.py",
    "tests/test_federation.py::test_a_two_round_federation_writes_every_output",
)
"""The tests that run on CUDA there: the two that compare the test device ($FEDST_TEST_DEVICE)
with the CPU, the pixel counts on CUDA (and the rest of that file, which takes seconds), and a
tiny federation whose ``train.device=auto`` resolves to the GPU. The other test files pin the CPU
or monkeypatch CUDA away."""

GPU_SIZES = Sizes(
    image=(512, 640),
    rounds=4,
    local_iters=20,
    eval_every=3,
    pretrain_iters=8,
    eval_frames=48,
    step_iters=5,
    step_repeats=3,
    stream_frames=60,
    scoring_repeats=20,
    compile_backend="inductor",
    budget_s=460,
    options_rounds=None,
    options_local_iters=10,
)
"""On the H200 (2026-11-28) each process started in ~10 s, the first round of a 512x640 run took
~35 s (cuDNN autotuning, loader start) and each later one ~15 s: a baseline or options run of
paper_scale needs ~95 s, which the budget cannot give, so the GPU check leaves them out and the
``step`` step compares the options in one process (docs/paper-scale.md)."""
CPU_SIZES = Sizes(
    image=(64, 80),
    rounds=4,
    local_iters=1,
    eval_every=3,
    pretrain_iters=3,
    eval_frames=2,
    step_iters=1,
    step_repeats=1,
    stream_frames=3,
    scoring_repeats=2,
    compile_backend="eager",
    budget_s=1680,
    options_rounds=2,
    options_local_iters=1,
    federation=("train.total_iters=1", "train.local_iters=1", "train.eval_max_frames=1"),
    outfed_frames=1,
    timeout_scale=4.0,
)

STEP_LIMITS_S = {
    "facts": 25,
    "federation": 75,
    "paper_scale": 170,
    "tests": 55,
    "scoring": 20,
    "step": 55,
    "stream": 60,
    "paper_scale_baseline": 45,
    "paper_scale_options": 45,
}
"""Each step's limit on the GPU (times ``Sizes.timeout_scale`` on the CPU), in the order they
run (by value: facts, federation, paper scale, tests, scoring, step, stream, options). Set from
the first run on the H200 (docs/paper-scale.md): a process there starts in ~10 s, matplotlib
builds its font cache once (~17 s, in ``facts``), and paper_scale at 4 rounds needs ~160 s. The
steps the GPU check runs add up to ``GPU_SIZES.budget_s``, so every step gets its turn."""

RUN_TIMEOUT_S = 520
"""The device tool's ``timeout_s`` for ``bash bench/gpu_check.sh``: the 460 s of steps, the
wheel install and pre-flight (about 25 s) and a margin. With a machine's start (30-120 s) it
leaves more than the 4 minutes of the 15-minute lease that a second, shorter call needs;
docs/paper-scale.md gives the call."""


def plan_steps(device: str, sizes: Sizes, work: Path) -> list[Step]:
    """The check's steps for ``device`` at ``sizes``; ``work`` holds their files."""
    python = sys.executable
    height, width = sizes.image
    fields = _config_fields()
    fed, infer = work / "federation" / "run", work / "federation" / "infer"
    tiny_root = work / "tiny"
    fed_overrides = [
        "experiment=tiny",
        f"train.device={device}",
        f"data.root={tiny_root}",
        f"hydra.run.dir={fed}",
        "progress=false",
        *sizes.federation,
    ]
    outfed = [] if sizes.outfed_frames is None else [f"max_frames={sizes.outfed_frames}"]

    def infer_command() -> list[str]:  # site A's first test video, once train_fed.py made it
        site = tiny_root / "A"
        video = (site / "splits" / "test.txt").read_text().split()[0]
        return [
            python,
            "-m",
            "fedst.infer",
            f"run={fed}",
            "site=A",
            f"input={site / 'videos' / video / 'frames'}",
            "fps=5",
            f"device={device}",
            f"output={infer}",
            "progress=false",
        ]

    def paper_scale(name: str, title: str, extra: list[str], rounds: int, iters: int) -> Step:
        missing = [o.split("=")[0] for o in extra if o.split("=")[0][6:] not in fields]
        path = work / f"{name}.json"
        main_run = name == "paper_scale"
        command = [
            python,
            "-m",
            "bench.paper_scale",
            "--tiny-data",
            "--tiny-preset",
            "gpu_check",
            "--image-size",
            str(height),
            str(width),
            "--rounds",
            str(rounds),
            "--local-iters",
            str(iters),
            "--eval-every",
            str(sizes.eval_every if main_run else rounds),
            "--pretrain-iters",
            str(sizes.pretrain_iters if main_run else 1),
            "--eval-frames",
            str(sizes.eval_frames),
            "--data-root",
            str(work / "gpu_check_data"),
            "--keep",
            str(work / name / "run"),
            "--json",
            str(path),
            f"train.device={device}",
            *extra,
        ]
        if device == "cpu":
            command.append("train.num_workers=0")
        return Step(
            name,
            title,
            STEP_LIMITS_S[name],
            [command],
            collect=lambda: _load(path),
            unsupported=(
                f"this checkout's TrainConfig has no field {', '.join(missing)}"
                if missing
                else None
            ),
            measures=PAPER_SCALE_MEASURES
            if main_run
            else "ms_per_site_step (compared with "
            "the other paper_scale runs); the other figures as paper_scale's, over fewer rounds",
        )

    def bench(module: str, *args: str, **options: object) -> list[str]:
        """``python -m <module> [args] --device <device> --<option> <value> ...``"""
        flags = [
            f for key, value in options.items() for f in (f"--{key.replace('_', '-')}", str(value))
        ]
        return [python, "-m", module, *args, "--device", device, *flags]

    baseline = ["train.amp_dtype=none", "train.tf32=false", _compile_override(fields, None)]
    if "channels_last" in fields:
        baseline.append("train.channels_last=false")
    options = [_compile_override(fields, "reduce-overhead"), "train.channels_last=true"]
    if device == "cpu":  # inductor's C++ build takes minutes on 2 cores: channels_last only
        options = ["train.channels_last=true"]
    step_json, stream_json = work / "step.json", work / "stream.json"
    facts_json, scoring_json = work / "facts.json", work / "scoring.json"
    size_args = ["--size", str(height), str(width)]
    return [
        Step(
            "facts",
            "device facts",
            STEP_LIMITS_S["facts"],
            [bench("bench.gpu_check", "facts", json=facts_json)],
            collect=lambda: _load(facts_json),
            measures="the machine as the check found it: torch, CUDA, the card, TF32 flags",
        ),
        Step(
            "federation",
            f"tiny federation end to end on {device}: train_fed.py, eval_outfed.py, fedst.infer",
            STEP_LIMITS_S["federation"],
            [
                [python, "train_fed.py", *fed_overrides],
                [python, "eval_outfed.py", f"run={fed}", "progress=false", *outfed],
                infer_command,
            ],
            collect=lambda: check_federation(fed, infer, device),
            measures="that the entry points run on the device (config.json and CUDA memory in "
            "train.jsonl); no timing",
        ),
        paper_scale(
            "paper_scale",
            f"paper_scale at {height}x{width}, paper.yaml's options",
            [],
            sizes.rounds,
            sizes.local_iters,
        ),
        Step(
            "tests",
            f"the tests that run on CUDA, with FEDST_TEST_DEVICE={device}",
            STEP_LIMITS_S["tests"],
            [[python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TEST_FILES]],
            env={"FEDST_TEST_DEVICE": device},
            measures="pass or fail of " + ", ".join(GPU_TEST_FILES),
        ),
        Step(
            "scoring",
            f"Dice / IoU pixel counts of one 1080p frame on {device} (bench.scoring)",
            STEP_LIMITS_S["scoring"],
            [bench("bench.scoring", repeats=sizes.scoring_repeats, json=scoring_json)],
            collect=lambda: _load(scoring_json),
            measures=f"ms per 1080x1920 frame of evaluation's scoring on {device} (median of "
            f"{sizes.scoring_repeats}, host copy and sync included) against MONAI's one-hot "
            "path on the CPU; the scores must be equal",
        ),
        Step(
            "step",
            f"training step at {height}x{width}: baseline (fp32, eager) vs the options",
            STEP_LIMITS_S["step"],
            [
                bench(
                    "bench.gpu_check",
                    "step",
                    *size_args,
                    iters=sizes.step_iters,
                    repeats=sizes.step_repeats,
                    budget_s=(STEP_LIMITS_S["step"] - 10) * sizes.timeout_scale,
                    compile_backend=sizes.compile_backend,
                    json=step_json,
                )
            ],
            collect=lambda: _load(step_json),
            measures=f"ms per training step (batch 2 of 4-frame clips, AdamW), the lowest mean "
            f"of {sizes.step_repeats} x {sizes.step_iters} steps after 3 warm-up steps, in one "
            "process; speed-ups against its fp32 eager baseline",
        ),
        Step(
            "stream",
            f"streaming inference FPS at {height}x{width}",
            STEP_LIMITS_S["stream"],
            [
                bench(
                    "bench.gpu_check",
                    "stream",
                    *size_args,
                    frames=sizes.stream_frames,
                    budget_s=(STEP_LIMITS_S["stream"] - 5) * sizes.timeout_scale,
                    compile_backend=sizes.compile_backend,
                    json=stream_json,
                )
            ],
            collect=lambda: _load(stream_json),
            measures=f"ms per frame (p50, p95) over {sizes.stream_frames} frames after warm-up, "
            "batch 1, a host sync per frame; logits of the first frames against eager fp32's. "
            "The paper reports 23 FPS (its GPU, its input size)",
        ),
    ] + (
        []
        if sizes.options_rounds is None
        else [
            paper_scale(
                "paper_scale_baseline",
                "paper_scale with none of the options (fp32, eager)",
                baseline,
                sizes.options_rounds,
                sizes.options_local_iters,
            ),
            paper_scale(
                "paper_scale_options",
                f"paper_scale with {' '.join(options)}",
                options,
                sizes.options_rounds,
                sizes.options_local_iters,
            ),
        ]
    )


PAPER_SCALE_MEASURES = (
    "ms_per_site_step: site compute per iteration over the rounds after the first; "
    "gpu_busy_fraction: nvidia-smi utilisation (every 100 ms) over the rounds that only train "
    "(gpu_busy_rounds: not the first or last, no evaluation, no checkpoint); "
    "evaluation_seconds_per_frame: the non-last evaluation (evaluation_rounds) over its frames, "
    "loader start included; pretrain_seconds_per_iter: the steps after 2 warm-up steps; "
    "paper_run_hours: 300 rounds x 100 iterations x 4 sites + SERQ + evaluation every 10 rounds "
    "+ 3000 pre-training iterations from these units (the paper: 43.8 h on one RTX A5000)"
)


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
    """A step's figures: a table of its variants (step, stream), else one line per figure."""
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
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
