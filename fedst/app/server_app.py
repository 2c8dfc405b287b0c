"""Flower ServerApp: the round loop of Algorithm 1 over any Grid (in-process, Ray, deployment).

Each round: send gamma_g to every connected site (a site's first round: the full initial model
v_g^0) -> sites train and reply with gamma_k -> Flower's FedAvg (uniform or sample-count weights,
fedst/federation/aggregation.py) or FedMedian aggregates the replies that came -> the server step
(SERQ for FedST) -> every ``eval_every`` rounds the sites score their personalized models ->
checkpoint. Only the
record "arrays" carries parameters, packed as a few buffers with a manifest
(fedst/federation/transport.py), and from the sites it only ever holds shared keys. The config in
each message is the site view of the experiment (no path of any site or of the server).

Sites that fail or time out are left out of the round as long as ``RoundPolicy.min_sites``
answered (participation.jsonl records who took part); they rejoin from their state on disk.

``app`` (module level) is the ServerApp of ``flwr run .`` and of ``train_fed.py site=server``:
it reads its run directory from the run config ([tool.flwr.app.config] in pyproject.toml).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedst.accel import PhasePeaks, memory_usage
from fedst.experiment import ExperimentConfig, RoundPolicy, resolve_device, site_view
from fedst.federation import privacy, transport
from fedst.federation.evaluation import METRICS_RECORD, scored_site
from fedst.federation.run_io import RunLog, atomic_torch_save, atomic_write_text
from fedst.federation.server import SERVER_CHECKPOINT, FederationServer
from fedst.federation.site import site_state_file
from fedst.federation.snapshots import save_shared_snapshot
from fedst.methods import PERSONAL_KEY_SEPARATOR, FinalStage
from fedst.metrics import METRIC_NAMES
from fedst.model.partition import COMPONENTS
from fedst.outfed import PERSONAL_EXPORT
from fedst.progress import progress_bar

log = logging.getLogger(__name__)


class FederationError(RuntimeError):
    """A site failed during a round; the message carries the site's own error text."""


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


class _Round:
    """The replies of one broadcast: good replies by site, and what failed or stayed silent."""

    def __init__(self) -> None:
        self.replies: list[Message] = []
        self.failed: dict[int, str] = {}


def _broadcast(
    grid: Grid,
    nodes: list[int],
    kind: str,
    payload: transport.Packed,
    config: dict[str, Any],
    server_round: int,
    timeout: float | None = None,
    first_payloads: dict[int, transport.Packed] | None = None,
    audit: RunLog | None = None,
    records: dict[int, dict[str, transport.Packed]] | None = None,
    poll: float = RoundPolicy.reply_poll,
) -> _Round:
    """Send ``payload`` (record "arrays") and config to every node (``first_payloads`` overrides
    the payload per node, ``records`` adds named packed records per node) and collect the
    replies; failures, silent nodes and replies whose parameters cannot be unpacked are
    returned, not raised."""
    messages = [
        Message(
            RecordDict(
                {
                    **(first_payloads or {}).get(node, payload).records("arrays"),
                    "config": ConfigRecord(config),
                    **{
                        part: record
                        for name, packed in (records or {}).get(node, {}).items()
                        for part, record in packed.records(name).items()
                    },
                }
            ),
            dst_node_id=node,
            message_type=kind,
            group_id=str(server_round),
            ttl=timeout,  # a site that comes back later does not work on a closed step
        )
        for node in nodes
    ]
    if audit is not None:
        for message in messages:
            _audit(audit, "down", message, server_round)
    result = _Round()
    answered = set()
    replies = _send_and_receive(grid, messages, timeout, poll)
    # the SuperLink's own error replies (e.g. node unavailable) do not come from the node:
    # match each reply to its instruction
    node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
    for reply in replies:
        node = node_of.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        answered.add(node)
        if audit is not None:
            _audit(audit, "up", reply, server_round)
        if reply.has_error():
            result.failed[node] = reply.error.reason
        elif (refusal := _wire_refusal(reply)) is not None:
            result.failed[node] = refusal
        else:
            result.replies.append(reply)
    for node in set(nodes) - answered:
        result.failed[node] = f"no reply within {timeout} s"
    return result


def _send_and_receive(
    grid: Grid, messages: list[Message], timeout: float | None, poll: float
) -> list[Message]:
    """Flower's ``Grid.send_and_receive`` with a pause of ``poll`` seconds between two requests
    for the replies (``deploy.reply_poll``) instead of its fixed 3 s: push the messages, then pull
    until every one has its reply or ``timeout`` seconds have passed."""
    pending = {message_id for message_id in grid.push_messages(messages) if message_id}
    deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    while pending:
        pulled = list(grid.pull_messages(sorted(pending)))
        replies += pulled
        pending -= {reply.metadata.reply_to_message_id for reply in pulled}
        if not pending or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(poll)
    return replies


def _wire_refusal(reply: Message) -> str | None:
    """Why the parameters of a reply cannot be unpacked (older layout, unknown manifest), or None."""
    try:
        for name in reply.content.array_records:
            transport.received(reply.content, name)
    except transport.WireFormatError as err:
        site = reply.content["site"]["site"] if "site" in reply.content else "?"
        return f"refused the reply of site {site}: {err}"
    return None


def _audit(runlog: RunLog, direction: str, message: Message, server_round: int) -> None:
    """One wire.jsonl row: what a message carried (record names; per packed record the keys and
    shapes its manifest lists, checked against its buffers; never values). A reply whose
    manifest does not match its buffers is logged with the reason it was refused."""
    row: dict[str, Any] = {
        "round": server_round,
        "direction": direction,
        "type": message.metadata.message_type,
        "node": message.metadata.dst_node_id
        if direction == "down"
        else message.metadata.src_node_id,
    }
    if not message.has_error():
        content = message.content
        try:
            row["arrays"] = transport.describe(content)
        except transport.WireFormatError as err:
            row["refused"] = str(err)
        row["configs"] = {
            name: sorted(record.keys()) for name, record in content.config_records.items()
        }
        row["metrics"] = {
            name: sorted(record.keys()) for name, record in content.metric_records.items()
        }
        if direction == "down" and "config" in content:
            row["config_values"] = {k: v for k, v in content["config"].items()}
    runlog.write("wire", row)


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


def _log_training_reply(
    runlog: RunLog,
    reply: Message,
    up: transport.Packed,
    down_sizes: dict[str, int],
    server_round: int,
    iterations: int,
    update_norm: float | None,
) -> None:
    """One comm row (``down_sizes`` measured once per round; ``up``: the reply's gamma_k as it
    travelled) and one train row per reply (``update_norm``: ||gamma_k - gamma_g^t||_2, what DP
    clipping bounds; None for Local)."""
    site, metrics = _site_of(reply), reply.content["metrics"]
    runlog.write(
        "comm",
        {
            "round": server_round,
            "site": site,
            **down_sizes,
            "upload_bytes": up.wire_bytes,
            "upload_param_bytes": up.param_bytes,
            "upload_param_bytes_by_component": _bytes_by_component(up),
        },
    )
    runlog.write(
        "train",
        {
            "round": server_round,
            "site": site,
            "iterations": iterations,
            "loss": float(metrics["train-loss"]),
            "seconds": float(metrics["seconds"]),
            **(
                {"loader_seconds": float(metrics["loader-seconds"])}
                if "loader-seconds" in metrics
                else {}
            ),
            "update_norm": update_norm,
        },
    )


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


def _site_of(reply: Message) -> str:
    return str(reply.content["site"]["site"])


def run_federation(
    grid: Grid,
    cfg: ExperimentConfig,
    run_dir: Path,
    progress: bool = True,
    policy: RoundPolicy | None = None,
) -> dict[str, Any]:
    """Run (or resume) the federation described by ``cfg``; returns the last per-site test metrics."""
    policy = policy or RoundPolicy()
    device = resolve_device(cfg.train.device)
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
    nodes = _wait_for_nodes(grid, len(federation), policy.join_timeout, federation)

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
            nodes = _wait_for_nodes(
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
            trained = _broadcast(
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
        _check_sites(trained, sites_of, federation, min_sites, "train", server_round)
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
            _log_training_reply(
                runlog, reply, up, down_sizes, server_round, cfg.train.local_iters, norm
            )
            unpacked.append(_with_arrays(reply, state))
            last_shared[_site_of(reply)] = {"round": server_round, "shared": state}
        participants = sorted(_site_of(r) for r in trained.replies)
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
                evaluated = _broadcast(
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
            _check_sites(evaluated, sites_of, federation, min_sites, "evaluate", server_round)
            frames = 0
            for reply in evaluated.replies:
                for row in _metrics_rows(reply, server_round):
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
            validated = _broadcast(
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
            _check_sites(validated, sites_of, federation, min_sites, "validate", server_round)
            for reply in validated.replies:
                for row in _metrics_rows(reply, server_round, split="val"):
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
        nodes = _wait_for_nodes(
            grid, len(federation), policy.join_timeout, federation, sites_of, required=min_sites
        )
        last_metrics = _run_final_stage(
            grid, server, stage, nodes, sites_of, base_config, policy, min_sites, runlog, audit
        )
    if policy.collect_personal and cfg.data.out_of_federation:
        _collect_personal(
            grid,
            sites_of,
            base_config,
            server.completed_round,
            run_dir,
            policy,
            audit,
            last_shared if method.returns_own_model else {},
        )
    runlog.close()
    return last_metrics


PERSONAL_EXCHANGE = "query.personal_exchange"
"""Before a final stage that needs every site's model: each site is asked for rho_k."""
FINAL_STAGE = "train.final_stage"
"""The final stage itself: gamma_g ("arrays") and the other sites' rho_j ("personal")."""


def _run_final_stage(
    grid: Grid,
    server: FederationServer,
    stage: FinalStage,
    nodes: list[int],
    sites_of: dict[int, str],
    base_config: dict[str, Any],
    policy: RoundPolicy,
    min_sites: int,
    runlog: RunLog,
    audit: RunLog | None,
) -> dict[str, Any]:
    """The method's stage after the last round T, logged as round T + 1: (with
    ``exchange_personal``) collect rho_k from the sites that allow it and send each of them the
    others' rho_j, with gamma_g, in ``train.final_stage``; then every site scores its final model.
    comm.jsonl gets one row per site with ``kind`` = the stage's name. Returns the metrics rows."""
    federation = list(server.cfg.data.federation)
    last_round, stage_round = server.completed_round, server.completed_round + 1
    config = {**base_config, "server-round": stage_round}
    precision = server.cfg.comm.precision
    nothing = transport.pack({}, precision)
    personal: dict[str, transport.Packed] = {}
    if stage.exchange_personal:
        collected = _broadcast(
            grid,
            nodes,
            PERSONAL_EXCHANGE,
            nothing,
            {**base_config, "server-round": last_round},
            stage_round,
            timeout=policy.round_timeout,
            poll=policy.reply_poll,
            audit=audit,
        )
        _check_sites(collected, sites_of, federation, min_sites, "personal exchange", stage_round)
        for reply in collected.replies:
            if int(reply.content["site"]["shared"]):
                personal[_site_of(reply)] = transport.received(reply.content, "personal")
            else:
                log.warning(
                    "site %s keeps its personalized parameters: not in %s",
                    _site_of(reply),
                    stage.name,
                )
    records = {
        node: {"personal": _others_personal(personal, sites_of[node], precision)}
        for node in nodes
        if sites_of.get(node) in personal
    }
    log.warning(
        "%s: personalized parameters of %s travel to the other sites that shared theirs",
        stage.name,
        sorted(personal) or "no site",
    )
    down = transport.pack(server.shared_payload(), precision)
    tuned = _broadcast(
        grid,
        nodes,
        FINAL_STAGE,
        down,
        config,
        stage_round,
        timeout=policy.round_timeout,
        poll=policy.reply_poll,
        audit=audit,
        records=records,
    )
    _check_sites(tuned, sites_of, federation, min_sites, stage.name, stage_round)
    node_of = {site: node for node, site in sites_of.items()}
    for reply in tuned.replies:
        site, metrics = _site_of(reply), reply.content["metrics"]
        received = records.get(node_of[site], {}).get("personal", nothing)
        sent = personal.get(site, nothing)
        runlog.write(
            "comm",
            {
                "round": stage_round,
                "site": site,
                "kind": stage.name,
                "download_bytes": down.wire_bytes + received.wire_bytes,
                "download_param_bytes": down.param_bytes + received.param_bytes,
                "upload_bytes": sent.wire_bytes,
                "upload_param_bytes": sent.param_bytes,
                "upload_param_bytes_by_component": _bytes_by_component(sent),
                "personal_download_param_bytes": received.param_bytes,
                "personal_upload_param_bytes": sent.param_bytes,
            },
        )
        runlog.write(
            "train",
            {
                "round": stage_round,
                "site": site,
                "stage": stage.name,
                "iterations": int(metrics.get("iterations", 0)),
                "ensemble_size": int(metrics["ensemble-size"]),
                "loss": float(metrics.get("train-loss", math.nan)),
                "seconds": float(metrics["seconds"]),
            },
        )
    evaluated = _broadcast(  # the sites' models are wholly their own now: nothing to send
        grid,
        [n for n in nodes if n in sites_of],
        MessageType.EVALUATE,
        nothing,
        config,
        stage_round,
        timeout=policy.eval_timeout,
        poll=policy.reply_poll,
        audit=audit,
    )
    _check_sites(evaluated, sites_of, federation, min_sites, "evaluate", stage_round)
    last_metrics = {}
    for reply in evaluated.replies:
        row = _metrics_row(reply, stage_round)
        runlog.write("metrics", row)
        last_metrics[row["site"]] = row
    server.save(stage_round, extra={"last_metrics": last_metrics, "final_stage": stage.name})
    log.info("%s done (round %d of the logs)", stage.name, stage_round)
    return last_metrics


def _others_personal(
    personal: dict[str, transport.Packed], site: str, precision: str
) -> transport.Packed:
    """The rho_j of every site but ``site``, keyed "<site j>/<key>" (client_app.final_stage),
    packed in ``precision`` (the values as the sites sent them: the restore to fp32 and the cast
    back are exact)."""
    return transport.pack(
        {
            f"{other}{PERSONAL_KEY_SEPARATOR}{key}": value
            for other, packed in personal.items()
            if other != site
            for key, value in packed.unpack().items()
        },
        precision,
    )


def _wait_for_nodes(
    grid: Grid,
    expected: int,
    timeout: float,
    federation: list[str],
    sites_of: dict[int, str] | None = None,
    required: int | None = None,
) -> list[int]:
    """The connected nodes, after waiting up to ``timeout`` s for ``expected`` of them; fewer than
    ``required`` (default: ``expected``) stops the run with the sites still missing."""
    required = expected if required is None else required
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= expected or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if len(nodes) < required:
        known = set((sites_of or {}).values())
        missing = [s for s in federation if s not in known] if known else federation
        raise FederationError(
            f"{len(nodes)} of {expected} sites connected after {timeout:.0f} s (need {required}); "
            f"not connected{' (or not yet seen)' if not known else ''}: {', '.join(missing)}. "
            f"Start them with: python train_fed.py site=<name> deploy.server=<host:port>"
        )
    if len(nodes) < expected:
        log.warning("%d of %d sites connected; going on with them", len(nodes), expected)
    return nodes


def _check_sites(
    result: _Round,
    sites_of: dict[int, str],
    federation: list[str],
    min_sites: int,
    kind: str,
    server_round: int,
) -> None:
    """Learn node -> site from the replies, refuse a site answering twice, and stop the run when
    fewer than ``min_sites`` sites answered."""
    seen: dict[str, int] = {}
    for reply in result.replies:
        node, site = reply.metadata.src_node_id, _site_of(reply)
        if site not in federation:
            raise FederationError(f"node {node} says it is site {site!r}, not in {federation}")
        if site in seen:
            raise FederationError(
                f"two SuperNodes ({seen[site]} and {node}) claim site {site}: give each hospital "
                f"its own site-name and key"
            )
        seen[site] = node
        sites_of[node] = site
    # federation order, not arrival order: the floating-point sum of the aggregation (and the
    # logs) must not depend on which site answered first
    result.replies.sort(key=lambda reply: federation.index(_site_of(reply)))
    failures = [f"{sites_of.get(n, f'node {n}')}: {reason}" for n, reason in result.failed.items()]
    if len(result.replies) < min_sites:
        raise FederationError(
            f"{len(failures)} site(s) failed during {kind} of round {server_round} and only "
            f"{len(result.replies)} answered (deploy.min_sites={min_sites}):\n"
            + "\n".join(failures)
        )
    for failure in failures:
        log.warning("round %d %s: left out %s", server_round, kind, failure.splitlines()[0])


def _collect_personal(
    grid: Grid,
    sites_of: dict[int, str],
    base_config: dict[str, Any],
    last_round: int,
    run_dir: Path,
    policy: RoundPolicy,
    audit: RunLog | None,
    last_shared: dict[str, dict],
) -> None:
    """Ask every site once for rho_k (the out-of-federation average); store what is sent in the
    run directory's site folders and write who sent and who declined to personal_export.json.

    With ``last_shared`` (method.returned_model=own) each stored state also gets the site's own
    gamma_k^T, taken from its reply of the last round (nothing more crosses the wire: the server
    received it then; under fp16 / bf16 transport it is the rounded gamma_k the site sent). A
    site that missed the last round has none: it is left out (``missed_last_round``)."""
    nodes = sorted(grid.get_node_ids())
    config = {**base_config, "server-round": last_round}
    result = _broadcast(
        grid,
        nodes,
        "query.personal",
        transport.pack({}, "fp32"),
        config,
        last_round,
        timeout=policy.round_timeout,
        poll=policy.reply_poll,
        audit=audit,
    )
    shared, declined, missed = [], [], []
    for reply in result.replies:
        site = _site_of(reply)
        if not int(reply.content["site"]["shared"]):
            declined.append(site)
            log.warning("site %s declined to send its personalized parameters", site)
            continue
        personal = transport.unpack(reply.content, "personal")
        state = {
            "round": last_round,
            "site": site,
            "personal": personal,
            "num_examples": int(reply.content["metrics"]["num-examples"]),
            "exported": True,
        }
        if last_shared:
            if last_shared.get(site, {}).get("round") != last_round:
                missed.append(site)
                log.warning("site %s sent no gamma_k in round %d: left out", site, last_round)
                continue
            state["shared"] = last_shared[site]["shared"]
        atomic_torch_save(state, site_state_file(run_dir / "sites" / site, last_round))
        shared.append(site)
        log.warning("site %s sent its personalized parameters (%d tensors)", site, len(personal))
    silent = [sites_of.get(n, f"node {n}") for n in result.failed]
    export = {
        "round": last_round,
        "shared": sorted(shared),
        "declined": sorted(declined),
        "unreachable": sorted(silent),
        "missed_last_round": sorted(missed),
    }
    atomic_write_text(json.dumps(export, indent=1), run_dir / PERSONAL_EXPORT)


def _bytes_by_component(packed: transport.Packed) -> dict[str, int]:
    """Parameter bytes of a payload per network component (fedst.model.partition.COMPONENTS),
    from its manifest (numel x element size of each tensor on the wire)."""
    sizes: dict[str, int] = {}
    for tensor in packed.tensors:
        name = next((c for c, p in COMPONENTS.items() if re.search(p, tensor.key)), "other")
        sizes[name] = sizes.get(name, 0) + tensor.nbytes
    return sizes


def _metrics_rows(reply: Message, server_round: int, split: str = "test") -> list[dict[str, Any]]:
    """The metrics.jsonl rows of an evaluate reply: one per split it scored (its site's own;
    the upper bound's pool: every federated site's), each with the scored site as "site"."""
    party = _site_of(reply)
    scored = {name: scored_site(name, party) for name in reply.content.metric_records}
    return [
        _metrics_row(reply, server_round, record, site, split)
        for record, site in scored.items()
        if site is not None
    ]


def _metrics_row(
    reply: Message,
    server_round: int,
    record: str = METRICS_RECORD,
    site: str | None = None,
    split: str = "test",
) -> dict[str, Any]:
    """One metrics.jsonl row from an evaluate reply's ``record`` (scores of ``site``'s ``split``,
    default: the replying site's own test split), in the layout of SegmentationMeter.summary(): a
    metric the reply leaves out (not scored: the class was absent from ground truth and prediction
    in every evaluated frame) is ``None`` (JSON null), never a number."""
    metrics = dict(reply.content[record])
    per_class: dict[str, dict[str, float | int | None]] = {}
    for key in [k for k in metrics if "/" in k]:
        class_name, metric = key.split("/", 1)
        per_class.setdefault(class_name, {})[metric] = metrics.pop(key)
    for values in per_class.values():
        values["frames"] = int(values.get("frames", 0))
        values.update({m: float(values[m]) if m in values else None for m in METRIC_NAMES})
    return {
        "round": server_round,
        "site": site or _site_of(reply),
        "split": split,
        "model": "personal",
        "num_frames": int(metrics.pop("num-examples")),
        **{m: float(metrics[m]) if m in metrics else None for m in METRIC_NAMES},
        "per_class": per_class,
    }
