"""The steps of the prepared GPU check (bench/gpu_check/check.py): what each runs and collects
(:func:`plan_steps`; the federation's evidence that the device was used, :func:`check_federation`),
at the reduced (``--cpu``) or full sizes (:data:`CPU_SIZES`, :data:`GPU_SIZES`), within each
step's time limit (:data:`STEP_LIMITS_S`)."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_check.runner import CheckFailed, Step

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
    from fedst.experiment import TrainConfig

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
    budget_s=490,
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
    budget_s=1960,
    options_rounds=2,
    options_local_iters=1,
    federation=("train.total_iters=1", "train.local_iters=1", "train.eval_max_frames=1"),
    outfed_frames=1,
    timeout_scale=4.0,
)

STEP_LIMITS_S = {
    "facts": 25,
    "federation": 75,
    "schedule": 200,
    "paper_scale": 170,
    "tests": 55,
    "scoring": 20,
    "step": 55,
    "stream": 60,
    "paper_scale_baseline": 45,
    "paper_scale_options": 45,
}
"""Each step's limit on the GPU (times ``Sizes.timeout_scale`` on the CPU), in the order they
run (by value: facts, federation, schedule, paper scale, tests, scoring, step, stream, options).
Set from the first run on the H200 (docs/paper-scale.md): a process there starts in ~10 s,
matplotlib builds its font cache once (~17 s, in ``facts``), and paper_scale at 4 rounds needs
~160 s. ``schedule`` (issue 60) replaces paper_scale on the GPU: its site rounds, SERQ,
evaluation and schedule arithmetic measure in one process what paper_scale measured through a
training run, plus the compile modes, the busy fraction and the sync check. The steps the GPU
check runs (facts, federation, schedule, tests, scoring, step, stream) add up to
``GPU_SIZES.budget_s``, so every step gets its turn."""

SCHEDULE_MARGIN_S = 25
"""Of the schedule step's limit, what its own budget leaves for the process start and the data."""

RUN_TIMEOUT_S = 540
"""The device tool's ``timeout_s`` for ``bash bench/gpu_check/gpu_check.sh`` (9 minutes): the 490 s of steps, the
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
    schedule_json = work / "schedule.json"
    facts_json, scoring_json = work / "facts.json", work / "scoring.json"
    size_args = ["--size", str(height), str(width)]
    return (
        [
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
            Step(
                "schedule",
                f"the paper's schedule from a site round at {height}x{width} (5, 20, 60 iterations), "
                "SERQ, pre-training and one evaluation, per compile mode",
                STEP_LIMITS_S["schedule"],
                [
                    bench(
                        "bench.gpu_check",
                        "schedule",
                        *size_args,
                        data_root=work / "gpu_check_data",
                        work=work / "schedule",
                        budget_s=(STEP_LIMITS_S["schedule"] - SCHEDULE_MARGIN_S)
                        * sizes.timeout_scale,
                        json=schedule_json,
                    )
                ],
                collect=lambda: _load(schedule_json),
                measures=SCHEDULE_MEASURES,
            ),
        ]
        + (
            []
            if sizes.options_rounds is None
            else [
                paper_scale(
                    "paper_scale",
                    f"paper_scale at {height}x{width}, paper.yaml's options",
                    [],
                    sizes.rounds,
                    sizes.local_iters,
                )
            ]
        )
        + [
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
        ]
        + (
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
    )


SCHEDULE_MEASURES = (
    "per compile mode (none, reduce-overhead, default; from a cold model; the CPU: none only): "
    "F_s and t_s, the fixed and per-iteration cost of a site round (Site.train_round) by least "
    "squares over rounds of 5, 20 and 60 iterations after a warm-up round of 3, and its excess "
    "over F + 3t (compile, autotuning, loader start); loader_wait_ms_per_call; "
    "cuda_event_step_ms over the 60-iteration round; busy (torch.profiler kernel time / wall over "
    "steady iterations); sync_debug_error_mode (the same iterations under "
    "torch.cuda.set_sync_debug_mode('error')); SERQ s per batch and pre-training s per iteration; "
    "one evaluation of the site's test split; paper_schedule_h: 300 rounds x (4 sites x "
    "(F + 100 t) + 100 SERQ batches) + 30 evaluations of 3718 frames + 3000 pre-training "
    "iterations, term by term. CUDA-only figures read 'not measured: no CUDA' on the CPU"
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
