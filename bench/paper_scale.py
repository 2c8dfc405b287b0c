"""The time budget of a paper-size FedST round: where a round's wall time goes, and the run it
extrapolates to (300 rounds x 100 local iterations, Sec. IV-A3).

    .venv/bin/python -m bench.paper_scale                       # 3 rounds x 4 iterations, 512x640
    .venv/bin/python -m bench.paper_scale --rounds 5 --local-iters 2   # memory over 5 rounds
    .venv/bin/python -m bench.paper_scale --smoke               # tiny preset: checks the script
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

Per round it prints, from the run's own log (train.jsonl; fedst/federation/run_io.py):
the sites' training compute and loader wait, the server step (aggregation, SERQ's EQ and SC),
the checkpoint's time and bytes, the evaluation's time per frame, everything else in the round
(messages, packing, restoring site states), and the process's resident memory (the in-process
engine holds every site); with CUDA, peak GPU memory and utilisation (nvidia-smi, sampled every
second). Then the paper's job from these per-unit figures: per site iteration, per SERQ batch,
per bank entry written (200 per round: 100 batches of 2), per evaluated frame (3718 test frames
of A-D, Table I, every 10 rounds). Rounds after the first are the steady state (the first pays
warm-up); with one round, that round. The targets (issue 22): everything outside the sites'
training steps at most 15 % of a round; checkpoint at most 100 MB per round; peak memory at most
6 GB; loader wait at most 5 % of the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

import torch

from fedst.accel import device_name

REPO = Path(__file__).resolve().parents[1]
DATA_ROOT = REPO / "data" / "procedural" / "paper_scale_v2"
MIB = 1024**2
GB = 1e9
PHASE_PEAK_SUFFIX = (
    "_peak_rss_bytes"  # train.jsonl: <phase>_peak_rss_bytes (fedst.accel.PhasePeaks)
)


@dataclass(frozen=True)
class PaperJob:
    """The paper's run (Sec. IV-A3, Table I) that the measured units extrapolate to."""

    rounds: int = 300
    local_iters: int = 100
    sites: int = 4
    serq_batches: int = 100
    serq_batch_size: int = 2
    synthetic_images: int = 3600  # SISVSE
    eval_every: int = 10
    test_frames: int = 600 + 996 + 1140 + 982  # A-D test frames, Table I
    pretrain_iters: int = 3000  # configs/experiment/paper.yaml (ours)
    checkpoint_every: int = 10  # configs/experiment/paper.yaml (ours); the run's own when read

    @property
    def bank_writes_per_round(self) -> int:
        """Bank entries SERQ refreshes per round."""
        return min(self.synthetic_images, self.serq_batches * self.serq_batch_size)

    @property
    def bank_writes_per_checkpoint(self) -> int:
        """Bank entries a checkpoint writes: those refreshed since the last one (the sampler
        visits every synthetic image once per epoch, so none twice within an epoch)."""
        return min(self.synthetic_images, self.checkpoint_every * self.bank_writes_per_round)


@dataclass
class RoundCost:
    """One measured round, seconds unless named otherwise (train.jsonl rows of that round)."""

    round: int
    site_iterations: int
    site_compute: float
    loader_wait: float
    aggregation: float
    serq_eq: float
    serq_sc: float
    serq_batches: int
    checkpoint: float
    server_checkpoint_bytes: int
    bank_bytes: int
    bank_entries: int
    evaluation: float
    evaluation_frames: int
    round_wall: float
    rss_bytes: int
    peak_rss_bytes: int
    cuda_peak_bytes: int | None = None
    phase_peak_bytes: dict[str, int] = field(default_factory=dict)
    """The process's peak during each phase (train, server_step, evaluation, checkpoint)."""

    @property
    def other(self) -> float:
        """The round's time outside every part above: messages, packing, site state files."""
        parts = self.site_compute + self.loader_wait + self.aggregation + self.serq_eq
        return self.round_wall - parts - self.serq_sc - self.checkpoint - self.evaluation


def round_costs(train_rows: list[dict], serq_batches: int) -> list[RoundCost]:
    """Per round from a run's train.jsonl rows (every site's row and the server's)."""
    by_round: dict[int, list[dict]] = {}
    for row in train_rows:
        if row.get("round", 0) >= 1 and "stage" not in row:
            by_round.setdefault(row["round"], []).append(row)
    costs = []
    for number, rows in sorted(by_round.items()):
        server = next(r for r in rows if r["site"] == "server")
        sites = [r for r in rows if r["site"] != "server"]
        loader = sum(r["loader_seconds"] for r in sites)
        costs.append(
            RoundCost(
                round=number,
                site_iterations=sum(r["iterations"] for r in sites),
                site_compute=sum(r["seconds"] for r in sites) - loader,
                loader_wait=loader,
                aggregation=server["aggregation_seconds"],
                serq_eq=server.get("eq_seconds", 0.0),
                serq_sc=server.get("sc_seconds", 0.0),
                serq_batches=serq_batches if "eq_seconds" in server else 0,
                checkpoint=server["checkpoint_seconds"],
                server_checkpoint_bytes=server["server_checkpoint_bytes"],
                bank_bytes=server["bank_bytes_written"],
                bank_entries=server["bank_entries_written"],
                evaluation=server.get("evaluation_seconds", 0.0),
                evaluation_frames=server.get("evaluation_frames", 0),
                round_wall=server["round_seconds"],
                rss_bytes=server["rss_bytes"],
                peak_rss_bytes=server["peak_rss_bytes"],
                cuda_peak_bytes=server.get("cuda_peak_bytes"),
                phase_peak_bytes={
                    key.removesuffix(PHASE_PEAK_SUFFIX): value
                    for key, value in server.items()
                    if key.endswith(PHASE_PEAK_SUFFIX)
                },
            )
        )
    return costs


def _per(total: float, count: int) -> float:
    return total / count if count else 0.0


@dataclass
class PaperRound:
    """The paper's round and run, from measured per-unit costs (seconds, bytes)."""

    site_compute: float
    loader_wait: float
    aggregation: float
    serq: float
    checkpoint: float
    checkpoint_bytes: float
    evaluation: float
    other: float
    run_hours: float
    bank_ram_bytes: float
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def wall(self) -> float:
        return sum(self.parts.values())


def extrapolate(
    steady: list[RoundCost], pretrain_seconds_per_iter: float, job: PaperJob = PaperJob()
) -> PaperRound:
    """The paper's round from the steady rounds' units: per site iteration (compute and loader
    wait), per SERQ batch (EQ + SC), per bank entry written, per evaluated frame; aggregation,
    ``server.pt`` and the rest of the round are per round. Evaluation is amortised over
    ``job.eval_every`` rounds."""
    iters = sum(c.site_iterations for c in steady)
    per_iter = _per(sum(c.site_compute for c in steady), iters)
    wait_per_iter = _per(sum(c.loader_wait for c in steady), iters)
    per_batch = _per(
        sum(c.serq_eq + c.serq_sc for c in steady), sum(c.serq_batches for c in steady)
    )
    entries = sum(c.bank_entries for c in steady)
    bank_entry_bytes = _per(sum(c.bank_bytes for c in steady), entries)
    saved = [c for c in steady if c.server_checkpoint_bytes] or steady
    server_pt_bytes = mean(c.server_checkpoint_bytes for c in saved)
    # checkpoint time by bytes: server.pt and bank entries are written by the same loop
    bytes_written = sum(c.server_checkpoint_bytes + c.bank_bytes for c in saved)
    seconds_per_byte = _per(sum(c.checkpoint for c in saved), int(bytes_written))
    evaluated = [c for c in steady if c.evaluation_frames]
    per_frame = _per(
        sum(c.evaluation for c in evaluated), sum(c.evaluation_frames for c in evaluated)
    )
    # a checkpoint every k rounds, amortised per round
    per_checkpoint = server_pt_bytes + job.bank_writes_per_checkpoint * bank_entry_bytes
    checkpoint_bytes = per_checkpoint / job.checkpoint_every
    parts = {
        "site compute": job.sites * job.local_iters * per_iter,
        "loader wait": job.sites * job.local_iters * wait_per_iter,
        "aggregation": mean(c.aggregation for c in steady),
        "SERQ (EQ + SC)": job.serq_batches * per_batch,
        "checkpoint": checkpoint_bytes * seconds_per_byte,
        "evaluation (amortised)": per_frame * job.test_frames / job.eval_every,
        "other": mean(max(c.other, 0.0) for c in steady),
    }
    run_seconds = job.rounds * sum(parts.values()) + job.pretrain_iters * pretrain_seconds_per_iter
    return PaperRound(
        site_compute=parts["site compute"],
        loader_wait=parts["loader wait"],
        aggregation=parts["aggregation"],
        serq=parts["SERQ (EQ + SC)"],
        checkpoint=parts["checkpoint"],
        checkpoint_bytes=checkpoint_bytes,
        evaluation=parts["evaluation (amortised)"],
        other=parts["other"],
        run_hours=run_seconds / 3600,
        bank_ram_bytes=job.synthetic_images * bank_entry_bytes,
        parts=parts,
    )


class GpuSampler:
    """nvidia-smi's utilisation (%) of every GPU, sampled every second while the run lasts."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        while not self._stop.wait(1.0):
            done = subprocess.run(query, capture_output=True, text=True, check=False)
            values = [float(v) for v in done.stdout.split() if v.strip().isdigit()]
            if values:
                self.samples.append(mean(values))

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Time and memory of a paper-size FedST round, and the run it extrapolates to.",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds to run (default 3)")
    parser.add_argument("--local-iters", type=int, default=4, help="site iterations per round")
    parser.add_argument("--pretrain-iters", type=int, default=4, help="v_pre pre-training iters")
    parser.add_argument("--eval-frames", type=int, default=16, help="test frames per site")
    parser.add_argument("--smoke", action="store_true", help="tiny preset at 64x80: seconds")
    parser.add_argument("--keep", type=Path, default=None, help="run directory (default: temp)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for train_fed.py")
    args = parser.parse_args(argv)
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONPATH": str(REPO)}
    run_dir = args.keep or Path(tempfile.mkdtemp(prefix="fedst_paper_scale_")) / "run"
    if args.smoke:
        data = ["data=tiny", "clip.image_size=[64,80]", f"data.root={run_dir.parent / 'tiny'}"]
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
        f"train.eval_every={args.rounds}",
        f"train.eval_max_frames={args.eval_frames}",
        f"serq.batches_per_round={k}",
        f"serq.pretrain_iters={args.pretrain_iters}",
        f"hydra.run.dir={run_dir}",
        "progress=false",
        *args.overrides,
    ]
    gpus = [device_name(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    print(f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cores; GPUs: {gpus or 'none'}")
    print(f"run: {run_dir}")
    started = time.perf_counter()
    with GpuSampler() as gpu:
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
    pretrain_per_iter = (
        _per(pretrain["pretrain_seconds"], pretrain["pretrain_iters"]) if pretrain else 0.0
    )
    print(f"\n{args.rounds} rounds x {k} iterations; the command took {wall:.0f} s, "
          f"peak RSS {peak_gb:.2f} GB (target <= 6 GB with the full bank, below)")  # fmt: skip
    _print_rounds(costs)
    if pretrain:
        print(f"pre-training: {pretrain_per_iter:.2f} s per iteration")
    if gpu.samples:
        print(f"GPU utilisation: mean {mean(gpu.samples):.0f}% over {len(gpu.samples)} samples")
    steady = costs[1:] if len(costs) > 1 else costs
    config = json.loads((run_dir / "config.json").read_text())
    job = PaperJob(checkpoint_every=config["train"]["checkpoint_every"])
    paper = extrapolate(steady, pretrain_per_iter, job)
    _print_paper(paper, job)
    filled = sum(c.bank_entries for c in costs)
    missing = max(job.synthetic_images - filled, 0) * _per(sum(c.bank_bytes for c in costs), filled)
    if config["serq"].get("bank_storage", "memory") == "disk":
        print(f"peak RSS with the whole bank filled: the measured {peak_gb:.2f} GB (serq.bank_storage"
              f"=disk: the bank's {paper.bank_ram_bytes / GB:.2f} GB are in a scratch file)")  # fmt: skip
    else:
        print(f"peak RSS with the whole bank filled: about {peak_gb + missing / GB:.2f} GB "
              f"(measured peak + the {job.synthetic_images - filled} entries not yet visited, "
              f"held in memory: serq.bank_storage=memory)")  # fmt: skip


if __name__ == "__main__":
    main()
