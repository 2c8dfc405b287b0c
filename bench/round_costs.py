"""A paper-size round's parts from its run log (train.jsonl rows: :func:`round_costs`), and the
paper's round and run extrapolated from their per-unit costs (:func:`extrapolate`): the arithmetic
of bench/paper_scale.py, which runs the round and prints these figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean

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


def per_unit(total: float, count: int) -> float:
    """``total / count``, 0 where ``count`` is 0 (no such unit measured)."""
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


def evaluation_rounds(costs: list[RoundCost]) -> list[RoundCost]:
    """The rounds whose evaluation stands for the paper's: those that evaluate, but not the
    last round (which also scores HD95 / ASSD: ``train.distance_metrics_every=null``) unless no
    other round evaluates."""
    evaluated = [c for c in costs if c.evaluation_frames]
    last = max((c.round for c in costs), default=None)
    return [c for c in evaluated if c.round != last] or evaluated


def evaluation_seconds_per_frame(costs: list[RoundCost]) -> float:
    """Seconds per evaluated frame over :func:`evaluation_rounds` (loader start included,
    amortised over their frames)."""
    rounds = evaluation_rounds(costs)
    return per_unit(sum(c.evaluation for c in rounds), sum(c.evaluation_frames for c in rounds))


def training_rounds(costs: list[RoundCost]) -> list[RoundCost]:
    """The rounds that only train: after the first (warm-up), before the last, and neither
    evaluating nor writing a checkpoint; the window of the GPU's busy fraction (the paper's
    round trains 100 iterations per site, evaluates every 10th and checkpoints rarely)."""
    if not costs:
        return []
    first, last = costs[0].round, costs[-1].round
    return [
        c
        for c in costs
        if first < c.round < last and not c.evaluation_frames and not c.server_checkpoint_bytes
    ]


def extrapolate(
    steady: list[RoundCost], pretrain_seconds_per_iter: float, job: PaperJob = PaperJob()
) -> PaperRound:
    """The paper's round from the steady rounds' units: per site iteration (compute and loader
    wait), per SERQ batch (EQ + SC), per bank entry written, per evaluated frame (from the
    rounds of :func:`evaluation_rounds`); aggregation, ``server.pt`` and the rest of the round
    are per round. Evaluation is amortised over ``job.eval_every`` rounds."""
    iters = sum(c.site_iterations for c in steady)
    per_iter = per_unit(sum(c.site_compute for c in steady), iters)
    wait_per_iter = per_unit(sum(c.loader_wait for c in steady), iters)
    per_batch = per_unit(
        sum(c.serq_eq + c.serq_sc for c in steady), sum(c.serq_batches for c in steady)
    )
    entries = sum(c.bank_entries for c in steady)
    bank_entry_bytes = per_unit(sum(c.bank_bytes for c in steady), entries)
    saved = [c for c in steady if c.server_checkpoint_bytes] or steady
    server_pt_bytes = mean(c.server_checkpoint_bytes for c in saved)
    # checkpoint time by bytes: server.pt and bank entries are written by the same loop
    bytes_written = sum(c.server_checkpoint_bytes + c.bank_bytes for c in saved)
    seconds_per_byte = per_unit(sum(c.checkpoint for c in saved), int(bytes_written))
    per_frame = evaluation_seconds_per_frame(steady)
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


def pretraining_cost(row: dict | None) -> tuple[float, str]:
    """Seconds per synthetic pre-training iteration from the run's round-0 row, and what the
    figure covers: the steps after warm-up where the row has them
    (fedst/methods/pretraining.py, ``WARMUP_ITERS``), else every step (older runs, or too few
    steps: then loader start and autotuning are in it)."""
    if row is None:
        return 0.0, "no pre-training"
    if row.get("pretrain_steady_iters"):
        per = per_unit(row["pretrain_steady_seconds"], row["pretrain_steady_iters"])
        return per, f"{row['pretrain_steady_iters']} steps after warm-up"
    per = per_unit(row["pretrain_seconds"], row["pretrain_iters"])
    return per, f"all {row['pretrain_iters']} steps, warm-up included (an upper bound)"
