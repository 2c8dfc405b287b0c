"""Flower ServerApp: the round loop of Algorithm 1 over any Grid (in-process, Ray, deployment).

Each round: send gamma_g to every connected site (a site's first round: the full initial model
v_g^0) -> sites train and reply with gamma_k -> Flower's FedAvg (uniform or sample-count weights,
fedst/methods/aggregation.py) or FedMedian aggregates the replies that came -> the server step
(SERQ for FedST) -> every ``eval_every`` rounds the sites score their personalized models ->
checkpoint. Only the
record "arrays" carries parameters, packed as a few buffers with a manifest
(fedst/federation/transport.py), and from the sites it only ever holds shared keys. The config in
each message is the site view of the experiment (no path of any site or of the server).

Sites that fail or time out are left out of the round as long as ``RoundPolicy.min_sites``
answered (participation.jsonl records who took part); they rejoin from their state on disk.

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

from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedst.accel import PhasePeaks, memory_usage, release_free_memory
from fedst.app.after_rounds import collect_personal, run_final_stage
from fedst.app.messaging import (
    FederationError,
    broadcast,
    check_sites,
    site_of,
    wait_for_nodes,
)
from fedst.app.reply_logs import log_training_reply, metrics_rows
from fedst.experiment import ExperimentConfig, RoundPolicy, run_device, site_view
from fedst.federation import transport
from fedst.federation.server import FederationServer
from fedst.federation.snapshots import save_shared_snapshot
from fedst.methods import privacy
from fedst.progress import progress_bar
from fedst.runs.files import RunLog
from fedst.runs.layout import SERVER_CHECKPOINT

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


def _with_arrays(reply: Message, state: dict) -> Message:
    """``reply`` as Flower's strategies take it: "arrays" with one Array per tensor (``state``,
    unpacked in fp32), no manifest; the reply itself stays as it arrived."""
    manifest = "arrays" + transport.MANIFEST_SUFFIX
    view = copy.copy(reply)
    view.content = RecordDict(
        {
            **{k: v for k, v in reply.content.items() if k not in ("arrays", manifest)},
            "arrays": ArrayRecord(state),
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
    """Run (or resume) the federation described by ``cfg``; returns the last per-site test metrics."""
    policy = policy or RoundPolicy()
    device = run_device(cfg)
    server = FederationServer(cfg, run_dir, device, progress=progress)
    runlog = RunLog(run_dir)
    audit = RunLog(run_dir, tensorboard=False) if policy.audit else None
    last_metrics: dict[str, Any] = {}
    if (run_dir / SERVER_CHECKPOINT).exists():
        last_metrics = server.load().get("last_metrics", {})
        runlog.truncate_after(server.completed_round)
        log.info("resuming %s after round %d", run_dir, server.completed_round)
    else:
        pretrain_started = time.perf_counter()
        pre_loss = server.initialize()
        if pre_loss is not None:
            row = {
                "round": 0,
                "site": "server",
                "synthetic_pretrain_loss": pre_loss,
                "pretrain_iters": cfg.serq.pretrain_iters,
                "pretrain_seconds": time.perf_counter() - pretrain_started,
            }
            runlog.write("train", row)
        server.save(0)

    method = server.method
    precision = cfg.comm.precision
    federation = list(method.training_sites())  # the federated sites (upper bound: its pool)
    min_sites = policy.min_sites or len(federation)
    if min_sites > len(federation):
        raise FederationError(
            f"deploy.min_sites={min_sites} but the federation has {len(federation)} sites"
        )
    base_config = {
        "experiment": site_view(cfg).to_json(),
        "run-name": run_dir.name,
        "local-iters": cfg.train.local_iters,
    }
    sites_of: dict[int, str] = {}  # node id -> site, learnt from the sites' replies
    last_shared: dict[str, dict] = {}  # site -> its latest gamma_k as received (the returned v_k)
    nodes = wait_for_nodes(grid, len(federation), policy.join_timeout, federation)

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
            nodes = wait_for_nodes(
                grid, len(federation), policy.join_timeout, federation, sites_of, required=min_sites
            )
        # -- local training at every site (Algorithm 1, lines 5-7) ------------------------------
        config = {
            **base_config,
            "server-round": server_round,
            # the sites keep their states of these rounds: a resumed run restarts after one
            **({"keep-rounds": kept} if (kept := server.checkpoint_rounds()) else {}),
            **method.instruction_config(server_round),
        }
        down = transport.pack(_train_payload(server, server_round), precision)
        first = _newcomer_payloads(server, server_round, nodes, sites_of)
        with peaks.phase("train"):  # in-process, the sites train in this process
            trained = broadcast(
                grid,
                nodes,
                MessageType.TRAIN,
                down,
                config,
                server_round,
                timeout=policy.round_timeout,
                poll=policy.reply_poll,
                first_payloads=first,
                audit=audit,
            )
        check_sites(trained, sites_of, federation, min_sites, "train", server_round)
        down_sizes = {
            "download_bytes": down.wire_bytes,
            "download_param_bytes": down.param_bytes,
        }
        received = server.shared_payload() if method.communicates else {}  # gamma_g^t
        unpacked = []
        for reply in trained.replies:
            # restored to fp32 before any aggregation (the bytes logged are those sent)
            up = transport.received(reply.content)
            state = up.unpack(expected=received)
            norm = privacy.update_l2_norm(state, received) if received else None
            log_training_reply(
                runlog, reply, up, down_sizes, server_round, cfg.train.local_iters, norm
            )
            unpacked.append(_with_arrays(reply, state))
            last_shared[site_of(reply)] = {"round": server_round, "shared": state}
        participants = sorted(site_of(r) for r in trained.replies)
        runlog.write(
            "participation",
            {
                "round": server_round,
                "participants": participants,
                "missing": [s for s in federation if s not in participants],
            },
        )
        # -- aggregation + server step (lines 8-12) -------------------------------------------------
        if method.communicates:
            step_started = time.perf_counter()
            with peaks.phase("server_step"):
                aggregated = method.aggregate(server_round, unpacked, received)
                aggregation_seconds = time.perf_counter() - step_started
                stats = server.server_step(aggregated, server_round)
                release_free_memory()  # SERQ's freed activations (fedst/accel.py)
            server_row = {
                "round": server_round,
                "site": "server",
                "aggregation_seconds": aggregation_seconds,
                "seconds": time.perf_counter() - step_started,  # aggregation + server step
                **stats,
            }
        # -- evaluation of the personalized models ---------------------------------------------
        timing: dict[str, float] = {}
        if server_round % cfg.train.eval_every == 0 or server_round == cfg.train.rounds:
            eval_started = time.perf_counter()
            shared = transport.pack(
                server.shared_payload() if method.communicates else {}, precision
            )
            with peaks.phase("evaluation"):
                evaluated = broadcast(
                    grid,
                    [n for n in nodes if n in sites_of],
                    MessageType.EVALUATE,
                    shared,
                    config,
                    server_round,
                    timeout=policy.eval_timeout,
                    poll=policy.reply_poll,
                    audit=audit,
                )
            check_sites(evaluated, sites_of, federation, min_sites, "evaluate", server_round)
            frames = 0
            for reply in evaluated.replies:
                for row in metrics_rows(reply, server_round):
                    runlog.write("metrics", row)
                    last_metrics[row["site"]] = row
                    frames += row["num_frames"]
            timing["evaluation_seconds"] = time.perf_counter() - eval_started
            timing["evaluation_frames"] = frames
        # -- validation scores of the personalized models (model selection, fedst/selection.py) --
        if cfg.train.val_every is not None and (
            server_round % cfg.train.val_every == 0 or server_round == cfg.train.rounds
        ):
            val_started = time.perf_counter()
            shared_params = server.shared_payload() if method.communicates else {}
            save_shared_snapshot(run_dir, server_round, shared_params)
            validated = broadcast(
                grid,
                [n for n in nodes if n in sites_of],
                MessageType.EVALUATE,
                transport.pack(shared_params, precision),
                {**config, "split": "val"},
                server_round,
                timeout=policy.eval_timeout,
                poll=policy.reply_poll,
                audit=audit,
            )
            check_sites(validated, sites_of, federation, min_sites, "validate", server_round)
            for reply in validated.replies:
                for row in metrics_rows(reply, server_round, split="val"):
                    runlog.write("metrics", row)
            timing["validation_seconds"] = time.perf_counter() - val_started
        with peaks.phase("checkpoint"):
            checkpoint = server.end_round(server_round, extra={"last_metrics": last_metrics})
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
        nodes = wait_for_nodes(
            grid, len(federation), policy.join_timeout, federation, sites_of, required=min_sites
        )
        last_metrics = run_final_stage(
            grid, server, stage, nodes, sites_of, base_config, policy, min_sites, runlog, audit
        )
    if policy.collect_personal and cfg.data.out_of_federation:
        collect_personal(
            grid,
            sites_of,
            base_config,
            server.completed_round,
            run_dir,
            policy,
            audit,
            last_shared if method.returns_own_model else {},
        )
    server.close()
    runlog.close()
    return last_metrics
