"""The time budget of a paper-size FedST round: where a round's wall time goes, and the run it
extrapolates to (300 rounds x 100 local iterations, Sec. IV-A3).

    .venv/bin/python -m bench.paper_scale                       # 3 rounds x 4 iterations, 512x640
    .venv/bin/python -m bench.paper_scale --rounds 5 --local-iters 2   # memory over 5 rounds
    .venv/bin/python -m bench.paper_scale --smoke               # tiny preset: checks the script
    .venv/bin/python -m bench.paper_scale --tiny-data --json ps.json train.device=cuda  # GPU check
    .venv/bin/python -m bench.paper_scale data=paper            # your own data (GPU machines)

One child process runs ``train_fed.py experiment=paper`` (the full network, 4-frame clips of
0.2 s, batch 2, 512x640, AdamW at the sites, the in-process engine with sequential sites) on the
procedural benchmark's ``paper_scale`` preset (rendered at 512x640, SISVSE's 3600 synthetic
images; generated once into data/procedural/paper_scale_v2 and timed). Two settings differ from
the paper's, because nothing can be downloaded here: a randomly initialised encoder
(``network.pretrained=false``) and one-hot site indicators (``method.indicator=onehot``);
neither changes a step's cost. A run has ``--rounds`` rounds of ``--local-iters`` iterations and
SERQ ``--local-iters`` server batches per round (the paper's ratio: 100 per 100), evaluates once,
at its last round, on at most ``--eval-frames`` test frames per site, and pre-trains v_pre
for ``--pretrain-iters`` iterations.

Per round it prints, from the run's own log (train.jsonl; fedst/runs/files.py; the arithmetic is
bench/round_costs.py):
the sites' training compute and loader wait, the server step (aggregation, SERQ's EQ and SC),
the checkpoint's time and bytes, the evaluation's time per frame, everything else in the round
(messages, packing, restoring site states), and the process's resident memory (the in-process
engine holds every site); with CUDA, peak GPU memory and utilisation (nvidia-smi, sampled every
100 ms). Then the paper's job from these per-unit figures: per site iteration, per SERQ batch,
per bank entry written (200 per round: 100 batches of 2), per evaluated frame (3718 test frames
of A-D, Table I, every 10 rounds). Rounds after the first are the steady state (the first pays
warm-up); with one round, that round. The targets (issue 22): everything outside the sites'
training steps at most 15 % of a round; checkpoint at most 100 MB per round; peak memory at most
6 GB; loader wait at most 5 % of the step time.

``--tiny-data`` trains on the tiny preset (64x80 frames, generated in a second) with every clip
resized to ``--image-size`` (default 512x640): the network, SERQ and the evaluation's forward
passes cost what they cost at that size, while the loader decodes smaller frames and evaluation
scores at the data's native 64x80 (bench/gpu_check/gpu_check.sh uses it: the paper_scale preset's 3600
images take minutes to render). ``--json`` also writes the figures below (and the device facts:
card, dtype, TF32, compile, channels_last) to a file. With nvidia-smi, the GPU's utilisation is
sampled every 100 ms and its mean over the steady rounds' wall time is the GPU busy fraction
(nvidia-smi's utilisation: the share of each sample period in which a kernel ran).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import mean

import torch

from bench.environment import child_environment
from bench.round_costs import (
    PaperJob,
    PaperRound,
    RoundCost,
    evaluation_rounds,
    evaluation_seconds_per_frame,
    extrapolate,
    per_unit,
    pretraining_cost,
    round_costs,
    training_rounds,
)
from bench.scratch import scratch_dir
from fedst.accel import device_name

REPO = Path(__file__).resolve().parents[1]
DATA_ROOT = REPO / "data" / "procedural" / "paper_scale_v2"
MIB = 1024**2
GB = 1e9


class GpuSampler:
    """nvidia-smi's utilisation (%) and memory used (MiB) of the GPUs every ``period_s`` while
    the run lasts (``nvidia-smi -lms``), and the time each round's server row reached
    ``train.jsonl`` (its end), so the samples of the steady rounds can be told apart."""

    def __init__(self, train_jsonl: Path, period_s: float = 0.1) -> None:
        self.samples: list[tuple[float, float, float]] = []
        """(monotonic s, utilisation %, memory used MiB): one per GPU and sample period."""
        self.round_ends: dict[int, float] = {}
        """round -> monotonic s when its server row was first seen in train.jsonl."""
        self.train_jsonl = train_jsonl
        self.period_s = period_s
        self.available = shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()
        self._process: subprocess.Popen | None = None
        self._threads: list[threading.Thread] = []

    def _read_samples(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            values = [v.strip() for v in line.split(",")]
            if len(values) == 2 and all(v.replace(".", "", 1).isdigit() for v in values):
                self.samples.append((time.monotonic(), float(values[0]), float(values[1])))

    def _watch_rounds(self) -> None:
        offset = 0
        while not self._stop.wait(self.period_s):
            if not self.train_jsonl.is_file():
                continue
            with open(self.train_jsonl, "rb") as handle:
                handle.seek(offset)
                data = handle.read()
            complete = data[: data.rfind(b"\n") + 1]  # whole rows only
            offset += len(complete)
            for line in complete.decode().splitlines():
                row = json.loads(line)
                if row.get("site") == "server" and "round" in row:
                    self.round_ends.setdefault(row["round"], time.monotonic())

    def __enter__(self) -> GpuSampler:
        self._threads = [threading.Thread(target=self._watch_rounds, daemon=True)]
        if self.available:
            self._process = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=utilization.gpu,memory.used",
                    "--format=csv,noheader,nounits",
                    f"-lms={round(self.period_s * 1000)}",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self._threads.append(threading.Thread(target=self._read_samples, daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
        for thread in self._threads:
            thread.join()

    def busy_fraction(self, rounds: list[int]) -> float | None:
        """Mean utilisation (0-1) over the samples inside ``rounds`` (each from the previous
        round's end to its own end); None without samples there."""
        windows = [
            (self.round_ends[r - 1], self.round_ends[r])
            for r in rounds
            if r in self.round_ends and r - 1 in self.round_ends
        ]
        inside = [u for t, u, _ in self.samples if any(a < t <= b for a, b in windows)]
        return mean(inside) / 100 if inside else None

    def peak_memory_mib(self) -> float | None:
        """The most GPU memory nvidia-smi saw in use (every process on the GPU)."""
        return max((m for _, _, m in self.samples), default=None)


def _train_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines()]


def _print_rounds(costs: list[RoundCost]) -> None:
    print(
        "| round | site compute s (iters) | loader wait s | aggregation s | SERQ EQ + SC s "
        "(batches) | checkpoint s, MB (bank entries) | evaluation s/frame (frames) | other s "
        "| round s | RSS GB (peak) | peak GB per phase |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in costs:
        frames = (
            f"{c.evaluation / c.evaluation_frames:.3f} ({c.evaluation_frames})"
            if c.evaluation_frames
            else "-"
        )
        cuda = f", GPU {c.cuda_peak_bytes / GB:.2f}" if c.cuda_peak_bytes else ""
        print(
            f"| {c.round} | {c.site_compute:.1f} ({c.site_iterations}) | {c.loader_wait:.2f} "
            f"| {c.aggregation:.2f} | {c.serq_eq + c.serq_sc:.1f} ({c.serq_batches}) "
            f"| {c.checkpoint:.2f}, {(c.server_checkpoint_bytes + c.bank_bytes) / 1e6:.0f} "
            f"({c.bank_entries}) | {frames} | {c.other:.1f} | {c.round_wall:.1f} "
            f"| {c.rss_bytes / GB:.2f} ({c.peak_rss_bytes / GB:.2f}){cuda} "
            f"| {', '.join(f'{k} {v / GB:.2f}' for k, v in c.phase_peak_bytes.items()) or '-'} |"
        )


def _print_paper(paper: PaperRound, job: PaperJob) -> None:
    wall = paper.wall
    print(f"\nThe paper's round ({job.sites} sites x {job.local_iters} iterations, "
          f"{job.serq_batches} SERQ batches, evaluation every {job.eval_every} rounds on "
          f"{job.test_frames} frames), extrapolated:")  # fmt: skip
    print("| part | s per round | share |")
    print("|---|---|---|")
    for name, seconds in paper.parts.items():
        print(f"| {name} | {seconds:.1f} | {seconds / wall:.1%} |")
    print(f"| **round** | {wall:.1f} | 100% |")
    outside = wall - paper.site_compute
    outside_not_serq = outside - paper.serq
    print(
        f"\noutside the sites' training compute: {outside / wall:.1%} of the round "
        f"(target <= 15%); of it, SERQ (the method's own server compute) {paper.serq / wall:.1%} "
        f"and the rest {outside_not_serq / wall:.1%}"
    )
    print(
        f"loader wait / site step time: "
        f"{paper.loader_wait / max(paper.site_compute + paper.loader_wait, 1e-9):.1%} (target <= 5%)"
    )
    print(
        f"checkpoint: every {job.checkpoint_every} rounds (train.checkpoint_every), "
        f"{paper.checkpoint_bytes / 1e6:.0f} MB per round amortised (target <= 100 MB), with "
        f"{job.bank_writes_per_checkpoint} bank entries per checkpoint; the full bank: "
        f"{paper.bank_ram_bytes / GB:.2f} GB"
    )
    print(f"whole run ({job.rounds} rounds + {job.pretrain_iters} pre-training iterations): "
          f"{paper.run_hours:.1f} h on this machine")  # fmt: skip


def device_facts(config: dict) -> dict[str, object]:
    """What the run used, from its config.json (``train``) and this process's torch: device,
    card, autocast dtype, TF32, compile, channels_last, cuDNN autotuning, loader workers."""
    train = config["train"]
    device = train.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    cuda = resolved.type == "cuda" and torch.cuda.is_available()
    amp = train.get("amp_dtype", "none")
    if not cuda or amp == "none":
        dtype = "fp32"
    elif amp == "auto":
        dtype = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    else:
        dtype = amp
    return {
        "device": str(resolved),
        "card": device_name(resolved) if cuda or resolved.type == "cpu" else "unavailable",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": dtype,
        "amp_dtype": amp,
        "tf32": bool(train.get("tf32", False)) and cuda,
        "compile": train.get("compile", False),
        "channels_last": train.get("channels_last", "not a config field"),
        "cudnn_benchmark": bool(train.get("cudnn_benchmark", False)) and cuda,
        "num_workers": train.get("num_workers"),
        "cpu_cores": os.cpu_count(),
    }


def summarise(
    costs: list[RoundCost],
    steady: list[RoundCost],
    paper: PaperRound,
    gpu: GpuSampler,
    config: dict,
    peak_rss_bytes: float,
    pretrain_seconds_per_iter: float = 0.0,
    pretrain_measure: str = "",
) -> dict[str, object]:
    """The figures of the GPU check (issues 33, 43): ms per site step, the GPU's busy fraction
    over the rounds that only train (:func:`training_rounds`), SERQ's, the loader wait's and the
    evaluation's shares (measured and in the paper's round), peak memory, the paper's run in
    hours and the device facts."""
    iters = sum(c.site_iterations for c in steady)
    measured_wall = sum(c.round_wall for c in steady)
    evaluated = evaluation_rounds(costs)
    eval_wall = sum(c.round_wall for c in evaluated)
    busy_window = training_rounds(costs)
    cuda_peaks = [c.cuda_peak_bytes for c in costs if c.cuda_peak_bytes]
    wall = paper.wall
    return {
        "device_facts": device_facts(config),
        "rounds": [c.round for c in costs],
        "steady_rounds": [c.round for c in steady],
        "ms_per_site_step": 1e3 * per_unit(sum(c.site_compute for c in steady), iters),
        "loader_wait_ms_per_site_step": 1e3 * per_unit(sum(c.loader_wait for c in steady), iters),
        "gpu_busy_fraction": gpu.busy_fraction([c.round for c in busy_window]),
        "gpu_busy_rounds": [c.round for c in busy_window],
        "gpu_samples": len(gpu.samples),
        "measured_shares": {
            "site compute": per_unit(sum(c.site_compute for c in steady), measured_wall),
            "loader wait": per_unit(sum(c.loader_wait for c in steady), measured_wall),
            "SERQ (EQ + SC)": per_unit(sum(c.serq_eq + c.serq_sc for c in steady), measured_wall),
            "evaluation (its rounds)": per_unit(sum(c.evaluation for c in evaluated), eval_wall),
        },
        "evaluation_seconds_per_frame": evaluation_seconds_per_frame(costs),
        "evaluation_rounds": [c.round for c in evaluated],
        "evaluation_frames": sum(c.evaluation_frames for c in evaluated),
        "pretrain_seconds_per_iter": pretrain_seconds_per_iter,
        "pretrain_measure": pretrain_measure,
        "paper_round_seconds": wall,
        "paper_round_shares": {
            name: per_unit(seconds, wall) for name, seconds in paper.parts.items()
        },
        "paper_run_hours": paper.run_hours,
        "peak_rss_bytes": peak_rss_bytes,
        "peak_cuda_allocated_bytes": max(cuda_peaks, default=None),
        "peak_gpu_memory_used_mib": gpu.peak_memory_mib(),
    }


def _print_summary(summary: dict) -> None:
    facts = summary["device_facts"]
    print("\ndevice: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    busy = summary["gpu_busy_fraction"]
    shares = summary["measured_shares"]
    paper = summary["paper_round_shares"]
    print(
        f"site step {summary['ms_per_site_step']:.1f} ms (+ loader wait "
        f"{summary['loader_wait_ms_per_site_step']:.1f} ms); GPU busy "
        f"{'n/a (no nvidia-smi samples)' if busy is None else f'{busy:.1%}'} of the rounds "
        f"that only train ({summary['gpu_busy_rounds'] or 'none'}; target >= 85%)"
    )
    print(
        f"measured shares of the steady rounds: SERQ {shares['SERQ (EQ + SC)']:.1%}, loader wait "
        f"{shares['loader wait']:.1%}; evaluation {shares['evaluation (its rounds)']:.1%} of the "
        f"rounds that evaluate ({summary['evaluation_seconds_per_frame'] * 1e3:.0f} ms per frame)"
    )
    print(
        f"the paper's round: SERQ {paper['SERQ (EQ + SC)']:.1%}, evaluation "
        f"{paper['evaluation (amortised)']:.1%} (amortised), loader wait "
        f"{paper['loader wait']:.1%}; the paper's schedule (300 rounds x 100 iterations x 4 "
        f"sites + SERQ): {summary['paper_run_hours']:.1f} h (target <= 4 h on one H100)"
    )
    cuda = summary["peak_cuda_allocated_bytes"]
    used = summary["peak_gpu_memory_used_mib"]
    print(
        f"peak memory: RSS {summary['peak_rss_bytes'] / GB:.2f} GB"
        + (f", CUDA allocated {cuda / GB:.2f} GB" if cuda else "")
        + (f", GPU used (nvidia-smi) {used / 1024:.2f} GiB" if used is not None else "")
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Time and memory of a paper-size FedST round, and the run it extrapolates to.",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds to run (default 3)")
    parser.add_argument("--local-iters", type=int, default=4, help="site iterations per round")
    parser.add_argument(
        "--eval-every", type=int, default=None,
        help="evaluate every k rounds and at the last (default: at the last only)",
    )  # fmt: skip
    parser.add_argument("--pretrain-iters", type=int, default=4, help="v_pre pre-training iters")
    parser.add_argument("--eval-frames", type=int, default=16, help="test frames per site")
    parser.add_argument("--smoke", action="store_true", help="tiny preset at 64x80: seconds")
    parser.add_argument(
        "--tiny-data",
        action="store_true",
        help="tiny preset's frames, clips resized to --image-size (seconds to generate)",
    )
    parser.add_argument(
        "--tiny-preset", default="tiny", choices=("tiny", "gpu_check"),
        help="--tiny-data's preset: gpu_check has 48 test frames per federated site (tiny: 6)",
    )  # fmt: skip
    parser.add_argument(
        "--image-size", type=int, nargs=2, default=None, metavar=("H", "W"),
        help="clip.image_size (default: 512 640, or 64 80 with --smoke)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--data-root", type=Path, default=None,
        help="where --smoke / --tiny-data keep the tiny preset (default: beside the run)",
    )  # fmt: skip
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="run directory to keep (default: a temporary one, removed at the end)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for train_fed.py")
    args = parser.parse_args(argv)
    env = child_environment()
    with scratch_dir("fedst_paper_scale_", args.keep) as scratch:
        run_dir = args.keep or scratch / "run"
        measure(args, run_dir, env)


def measure(args: argparse.Namespace, run_dir: Path, env: dict[str, str]) -> None:
    """Train the job of ``args`` into ``run_dir`` and print what its rounds cost."""
    if args.smoke or args.tiny_data:
        height, width = args.image_size or ((64, 80) if args.smoke else (512, 640))
        data = [
            "data=tiny",
            f"data.procedural={args.tiny_preset}",
            f"clip.image_size=[{height},{width}]",
            f"data.root={args.data_root or run_dir.parent / args.tiny_preset}",
        ]
    else:
        data = ["data=demo", f"data.root={DATA_ROOT}", "data.procedural=paper_scale"]
        if not any(o.startswith("data=") for o in args.overrides):
            started = time.perf_counter()
            from fedst.data.procedural import generate

            generated = generate(DATA_ROOT, 0, "paper_scale", workers=2, progress=True)
            if any(site["generated"] for site in generated.values()):
                print(f"generated {DATA_ROOT} in {time.perf_counter() - started:.0f} s")
    k = args.local_iters
    command = [
        sys.executable,
        str(REPO / "train_fed.py"),
        "experiment=paper",
        *data,
        "network.pretrained=false",
        "method.indicator=onehot",
        f"train.local_iters={k}",
        f"train.total_iters={k * args.rounds}",
        f"train.eval_every={args.eval_every or args.rounds}",
        f"train.eval_max_frames={args.eval_frames}",
        f"serq.batches_per_round={k}",
        f"pretraining.iters={args.pretrain_iters}",
        f"hydra.run.dir={run_dir}",
        "progress=false",
        *args.overrides,
    ]
    gpus = [device_name(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    print(f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cores; GPUs: {gpus or 'none'}")
    print(f"run: {run_dir}" + ("" if args.keep else " (removed at the end; --keep DIR keeps it)"))
    started = time.perf_counter()
    with GpuSampler(run_dir / "train.jsonl") as gpu:
        done = subprocess.run(command, cwd=REPO, env=env, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"train_fed.py failed (exit {done.returncode}); its log: {run_dir / 'log.txt'}")
    rows = _train_rows(run_dir)
    costs = round_costs(rows, serq_batches=k)
    # the child's ru_maxrss misses the peaks before its PhasePeaks resets (fedst.accel): the run
    # log's per-phase peaks hold them
    logged_peak = max(
        (max([c.peak_rss_bytes, *c.phase_peak_bytes.values()]) for c in costs), default=0
    )
    peak_gb = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, logged_peak) / GB
    pretrain = next((r for r in rows if r.get("round") == 0 and "pretrain_seconds" in r), None)
    pretrain_per_iter, pretrain_measure = pretraining_cost(pretrain)
    print(f"\n{args.rounds} rounds x {k} iterations; the command took {wall:.0f} s, "
          f"peak RSS {peak_gb:.2f} GB (target <= 6 GB with the full bank, below)")  # fmt: skip
    _print_rounds(costs)
    if pretrain:
        print(f"pre-training: {pretrain_per_iter:.3f} s per iteration ({pretrain_measure})")
    steady = costs[1:] if len(costs) > 1 else costs
    config = json.loads((run_dir / "config.json").read_text())
    job = PaperJob(checkpoint_every=config["train"]["checkpoint_every"])
    paper = extrapolate(steady, pretrain_per_iter, job)
    _print_paper(paper, job)
    filled = sum(c.bank_entries for c in costs)
    missing = max(job.synthetic_images - filled, 0) * per_unit(
        sum(c.bank_bytes for c in costs), filled
    )
    if config["serq"].get("bank_storage", "memory") == "disk":
        print(f"peak RSS with the whole bank filled: the measured {peak_gb:.2f} GB (serq.bank_storage"
              f"=disk: the bank's {paper.bank_ram_bytes / GB:.2f} GB are in a scratch file)")  # fmt: skip
    else:
        print(f"peak RSS with the whole bank filled: about {peak_gb + missing / GB:.2f} GB "
              f"(measured peak + the {job.synthetic_images - filled} entries not yet visited, "
              f"held in memory: serq.bank_storage=memory)")  # fmt: skip
    summary = summarise(
        costs, steady, paper, gpu, config, peak_gb * GB, pretrain_per_iter, pretrain_measure
    )
    _print_summary(summary)
    if args.json is not None:
        args.json.write_text(json.dumps({**summary, "command": command, "wall_seconds": wall}))
        print(f"figures: {args.json}")


if __name__ == "__main__":
    main()
