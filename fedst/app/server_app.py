"""Flower ServerApp: the round loop of Algorithm 1 over any Grid (in-process, Ray, deployment).

Each round: send gamma_g to every connected site (a site's first round: the full initial model
v_g^0) -> sites train and reply with gamma_k -> Flower's FedAvg (uniform or sample-count weights,
fedst/methods/aggregation.py) or FedMedian aggregates the replies that came -> the server step
(SERQ for FedST) -> every ``eval_every`` rounds the sites score their personalized models ->
checkpoint. Only the
record "arrays" carries parameters, packed as a few buffers with a manifest
(fedst/federation/transport.py), and from the sites it only ever holds shared keys. The config in
each message is the site view of the experiment (no path of any site or of the server).

Every reply is checked before it is used (the reply schema, fedst/app/reply_schema.py, then
fedst/federation/reply_checks.py, through ``SiteGrid.ask``: round, site, keys, shapes, dtypes,
finite values, magnitude, sample count, optionally the update norm); a refused reply counts as a
failed site. The server computes every aggregation weight itself (uniform, validated n_k, or a
scalar the method declares, bounded) and checks its own aggregate, and its model after the server
step, before storing or sending it: an aggregate with NaN, inf or a value beyond the magnitude
bound stops the run with one line naming the sites averaged (nothing of the round is kept).
Sites that fail, are refused or time out are left out of the round as long as
``RoundPolicy.min_sites`` answered (participation.jsonl records who took part); they rejoin from
their state on disk.

The deployed ServerApp of ``flwr run .`` and of ``train_fed.py site=server`` is ``app`` in
fedst/deploy/server_app.py: it reads its run directory from the run config ([tool.flwr.app.config] in
pyproject.toml) and calls :func:`run_federation`.

The pieces the loop uses: fedst/app/messaging.py (broadcasts, replies, failures, the wire audit),
fedst/app/reply_logs.py (the comm, train and metrics rows of the replies) and
fedst/app/after_rounds.py (a method's final stage, the collection of rho_k).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedst.accel import PhasePeaks, memory_usage, release_free_memory
from fedst.app import keys
from fedst.app.after_rounds import collect_personal, run_final_stage
from fedst.app.messaging import FederationError, SiteGrid, site_of
from fedst.app.reply_logs import log_training_reply, metrics_rows
from fedst.app.site_statistics import collect_site_statistics
from fedst.experiment import ExperimentConfig, RoundPolicy, run_device, site_view
from fedst.federation import transport
from fedst.federation.reply_checks import ReplyChecker, aggregate_problem, magnitude_bound
from fedst.federation.server import FederationServer
from fedst.federation.snapshots import save_shared_snapshot
from fedst.progress import progress_bar
from fedst.runs.files import RunLog
from fedst.runs.layout import SERVER_CHECKPOINT, SITE_STATS_JSON

log = logging.getLogger(__name__)


def make_server_app(
    cfg: ExperimentConfig,
    run_dir: Path,
    progress: bool = True,
    policy: RoundPolicy | None = None,
) -> ServerApp:
    """A ServerApp bound to one experiment (config comes from the entry point, not from Flower)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_federation(grid, cfg, run_dir, progress=progress, policy=policy)

    return app


def _train_payload(server: FederationServer, server_round: int) -> dict:
    """Round 1: the server's full initial model v_g^0; later: gamma_g (nothing without communication)."""
    if server_round == 1:
        return server.initial_payload()
    return server.shared_payload() if server.method.communicates else {}


def _newcomer_payloads(
    server: FederationServer,
    server_round: int,
    nodes: list[int],
    sites_of: dict[int, str],
) -> dict[int, transport.Packed]:
    """After round 1, a node not seen yet in this server process (it joined late, or the server
    resumed) gets the full current v_g: a site without private state starts from it, a site
    with state takes only gamma_g from it (Site.train_round)."""
    newcomers = [n for n in nodes if n not in sites_of]
    if server_round == 1 or not server.method.communicates or not newcomers:
        return {}
    full = transport.pack(server.initial_payload(), server.cfg.comm.precision)
    return dict.fromkeys(newcomers, full)


def _with_arrays(reply: Message, state: dict, weight_key: str, weight: float) -> Message:
    """``reply`` as Flower's strategies take it: "arrays" with one Array per tensor (``state``,
    unpacked in fp32), no manifest, and "metrics" holding only the aggregation weight the server
    computed, under the key the strategy weighs by (``weight_key``): no site-sent value reaches
    the averaging, and every reply's MetricRecord has the same key whatever else sites send.
    The reply itself stays as it arrived."""
    view = copy.copy(reply)
    view.content = RecordDict(
        {
            keys.ARRAYS: ArrayRecord(state),
            keys.METRICS: MetricRecord({weight_key: weight}),
            keys.SITE: reply.content[keys.SITE],
        }
    )
    return view


def run_federation(
    grid: Grid,
    cfg: ExperimentConfig,
    run_dir: Path,
    progress: bool = True,
    policy: RoundPolicy | None = None,
) -> dict[str, Any]:
    """Run (or resume) the federation described by ``cfg`` (Algorithm 1); returns the last
    per-site test metrics."""
    policy = policy or RoundPolicy()
    server = FederationServer(cfg, run_dir, run_device(cfg), progress=progress)
    runlog = RunLog(run_dir)
    resumed = _start_or_resume(server, runlog)
    last_metrics = resumed.get("last_metrics", {})
    method = server.method
    audit = RunLog(run_dir, tensorboard=False) if policy.audit else None
    # every reply is checked before it is used (fedst/federation/reply_checks.py)
    checker = ReplyChecker(
        cfg.fed.max_update_ratio,
        resumed.get("data_sizes"),
        max_data_change=cfg.fed.max_data_change,
        bound=magnitude_bound(cfg.comm.precision),
        weight_by=method.weight_source(),
        declared=method.reply_scalars,
    )
    # the upper bound's federation is its pool
    sites = SiteGrid(grid, method.training_sites(), policy, audit, checker, runlog)
    base_config = {
        keys.EXPERIMENT: site_view(cfg).to_json(),
        keys.RUN_NAME: run_dir.name,
        keys.LOCAL_ITERS: cfg.train.local_iters,
    }
    last_shared: dict[str, dict] = {}  # site -> its latest gamma_k as received (the returned v_k)
    sites.connect(required=len(sites.federation))
    pools = [party for party in sites.federation if party not in cfg.data.sites]
    if pools:  # the upper bound's pooled party: no site of its own to describe
        log.info("site statistics: not asked (training parties %s pool several sites)", pools)
    elif not (run_dir / SITE_STATS_JSON).exists():  # once per run, before any training
        collect_site_statistics(sites, base_config, server.completed_round, run_dir)
    rounds = range(server.completed_round + 1, cfg.train.rounds + 1)
    for server_round in progress_bar(
        rounds,
        desc=f"{method.name} rounds",
        enabled=progress,
        initial=server.completed_round,
        total=cfg.train.rounds,
    ):
        started = time.perf_counter()
        peaks = PhasePeaks()  # the process's peak memory per phase of this round
        if server_round > rounds.start:
            sites.connect()
        config = {
            **base_config,
            keys.SERVER_ROUND: server_round,
            # the sites keep their states of these rounds: a resumed run restarts after one
            **({keys.KEEP_ROUNDS: kept} if (kept := server.checkpoint_rounds()) else {}),
            **method.instruction_config(server_round),
        }
        # -- local training at every site (Algorithm 1, lines 5-7) ------------------------------
        with peaks.phase("train"):  # in-process, the sites train in this process
            replies, received = _train(sites, server, config, server_round, runlog, last_shared)
        # -- aggregation + server step (lines 8-12) ---------------------------------------------
        if method.communicates:
            with peaks.phase("server_step"):
                server_row = _aggregate_and_step(server, replies, received, server_round)
        # -- the personalized models scored: test, and validation for model selection -----------
        timing: dict[str, float] = {}
        if _due(server_round, cfg.train.eval_every, cfg.train.rounds):
            with peaks.phase("evaluation"):
                timing.update(
                    _score(sites, server, config, server_round, runlog, "test", last_metrics)
                )
        if cfg.train.val_every is not None and _due(
            server_round, cfg.train.val_every, cfg.train.rounds
        ):
            timing.update(_score(sites, server, config, server_round, runlog, "val", last_metrics))
        with peaks.phase("checkpoint"):
            extra = {"last_metrics": last_metrics, "data_sizes": dict(checker.data_sizes)}
            checkpoint = server.end_round(server_round, extra=extra)
        if method.communicates:  # written with the round's checkpoint time and bytes
            timing["round_seconds"] = time.perf_counter() - started
            memory = {**memory_usage(), **peaks.row()}
            runlog.write("train", {**server_row, **checkpoint, **timing, **memory})
        log.info(  # the one line per round of a non-terminal log (fedst/progress.py)
            "round %d/%d done in %.1f s",
            server_round,
            cfg.train.rounds,
            time.perf_counter() - started,
        )
    stage = method.final_stage()
    if stage is not None and server.completed_round == cfg.train.rounds:
        sites.connect()
        last_metrics = run_final_stage(sites, server, stage, base_config, runlog)
    if policy.collect_personal and cfg.data.out_of_federation:
        own = last_shared if method.returns_own_model else {}
        collect_personal(sites, base_config, server.completed_round, run_dir, own)
    server.close()
    runlog.close()
    return last_metrics


def _due(server_round: int, every: int, last: int) -> bool:
    """Every ``every`` rounds and at the last one."""
    return server_round % every == 0 or server_round == last


def _start_or_resume(server: FederationServer, runlog: RunLog) -> dict[str, Any]:
    """Resume from the run's checkpoint (logs cut back to it), or start: synthetic pre-training
    (Algorithm 1, line 3; logged as round 0) and the checkpoint of round 0. Returns what a
    resumed run's checkpoint kept beside the models (the last per-site metrics, the sites' data
    sizes); empty for a new run."""
    run_dir = server.run_dir
    if (run_dir / SERVER_CHECKPOINT).exists():
        extra = server.load()
        runlog.truncate_after(server.completed_round)
        log.info("resuming %s after round %d", run_dir, server.completed_round)
        return extra
    pretrain_started = time.perf_counter()
    pretrained = server.initialize()
    if pretrained is not None:
        row = {
            "round": 0,
            "site": "server",
            "synthetic_pretrain_loss": pretrained.loss,
            "pretrain_iters": server.cfg.pretraining.iters,
            "pretrain_seconds": time.perf_counter() - pretrain_started,
            # after the first steps (loader start, autotuning): what one more step costs
            "pretrain_steady_seconds": pretrained.steady_seconds,
            "pretrain_steady_iters": pretrained.steady_iters,
        }
        runlog.write("train", row)
    server.save(0)
    return {}


def _train(
    sites: SiteGrid,
    server: FederationServer,
    config: dict[str, Any],
    server_round: int,
    runlog: RunLog,
    last_shared: dict[str, dict],
) -> tuple[list[Message], dict]:
    """One round of local training: gamma_g down (a newcomer: the whole v_g), gamma_k up,
    restored to fp32 and logged (comm, train, participation). Returns the replies as Flower's
    strategies take them and gamma_g^t they were trained from."""
    precision = server.cfg.comm.precision
    down = transport.pack(_train_payload(server, server_round), precision)
    first = _newcomer_payloads(server, server_round, sites.nodes, sites.sites_of)
    received = server.shared_payload() if server.method.communicates else {}  # gamma_g^t
    trained = sites.ask(  # each gamma_k checked against gamma_g^t when it is to be aggregated
        MessageType.TRAIN,
        down,
        config,
        server_round,
        "train",
        first_payloads=first,
        reference=received if server.method.communicates else None,
    )
    down_sizes = {"download_bytes": down.wire_bytes, "download_param_bytes": down.param_bytes}
    local_iters = server.cfg.train.local_iters
    unpacked = []
    for reply in trained.replies:
        # restored to fp32 before any aggregation (the bytes logged are those sent)
        up, site = transport.received(reply.content), site_of(reply)
        state = trained.states[site] if site in trained.states else up.unpack()
        norm = trained.norms.get(site)
        log_training_reply(runlog, reply, up, down_sizes, server_round, local_iters, norm)
        weight = trained.weights.get(site, 1.0)  # none without communication: nothing averaged
        unpacked.append(_with_arrays(reply, state, server.method.weight_key(), weight))
        last_shared[site] = {"round": server_round, "shared": state}
    participants = sorted(site_of(r) for r in trained.replies)
    missing = [s for s in sites.federation if s not in participants]
    runlog.write(
        "participation",
        {"round": server_round, "participants": participants, "missing": missing},
    )
    return unpacked, received


def _aggregate_and_step(
    server: FederationServer, replies: list[Message], received: dict, server_round: int
) -> dict[str, Any]:
    """The method's aggregation, then the server step (SERQ for FedST); the server's train row."""
    step_started = time.perf_counter()
    aggregated = server.method.aggregate(server_round, replies, received)
    aggregation_seconds = time.perf_counter() - step_started
    bound = magnitude_bound(server.cfg.comm.precision)
    _refuse_own_model(aggregated, bound, "aggregate", replies, server_round)
    stats = server.server_step(aggregated, server_round)
    release_free_memory()  # the server step's freed activations (fedst/accel/memory.py)
    if server.step is not None:
        after = server.shared_payload()
        _refuse_own_model(after, bound, "model after the server step", replies, server_round)
    return {
        "round": server_round,
        "site": "server",
        "aggregation_seconds": aggregation_seconds,
        "seconds": time.perf_counter() - step_started,  # aggregation + server step
        **stats,
    }


def _refuse_own_model(
    state: dict, bound: float, what: str, replies: list[Message], server_round: int
) -> None:
    """Stop the run (FederationError, one line naming the sites averaged) when the server's own
    ``state`` (its aggregate, or gamma_g after its server step) may not be stored or sent
    (fedst/federation/reply_checks.aggregate_problem); the round is refused as a whole."""
    problem = aggregate_problem(state, bound)
    if problem is None:
        return
    sites = ", ".join(site_of(reply) for reply in replies)
    raise FederationError(
        f"round {server_round}: the server's {what} of sites {sites} is refused: {problem}; "
        f"nothing of round {server_round} is stored or sent. The run keeps its last completed "
        f"round: resume it with train_fed.py resume=<run dir> (fed.max_update_ratio or "
        f"method.aggregation=fedmedian guard against an outlying site)"
    )


def _score(
    sites: SiteGrid,
    server: FederationServer,
    config: dict[str, Any],
    server_round: int,
    runlog: RunLog,
    split: str,
    last_metrics: dict[str, Any],
) -> dict[str, float]:
    """Every site scores its personalized model on its ``split``: "test" (metrics rows, the
    latest kept in ``last_metrics``; returns the seconds and frames) or "val" for model selection
    (fedst/runs/model_selection.py: gamma_g's snapshot of the round is kept first; returns the seconds)."""
    started = time.perf_counter()
    shared = server.shared_payload() if server.method.communicates else {}
    if split == "val":
        save_shared_snapshot(server.run_dir, server_round, shared)
        config = {**config, keys.SPLIT: "val"}
    scored = sites.ask(
        MessageType.EVALUATE,
        transport.pack(shared, server.cfg.comm.precision),
        config,
        server_round,
        "evaluate" if split == "test" else "validate",
        nodes=sites.known_nodes(),
    )
    frames = 0
    for reply in scored.replies:
        for row in metrics_rows(reply, server_round, split=split):
            runlog.write("metrics", row)
            if split == "test":
                last_metrics[row["site"]] = row
                frames += row["num_frames"]
    if split == "val":
        return {"validation_seconds": time.perf_counter() - started}
    return {"evaluation_seconds": time.perf_counter() - started, "evaluation_frames": frames}
