"""Flower ServerApp: the round loop of Algorithm 1 over any Grid (in-process, Ray, deployment).

Each round: send gamma_g to every site (round 1: the full initial model v_g^0) -> sites train and
reply with gamma_k -> Flower's FedAvg (uniform or sample-count weights, see
fedst/federation/aggregation.py) or FedMedian aggregates -> the server step (SERQ for FedST) ->
every ``eval_every`` rounds the sites score their personalized models -> checkpoint. Only the
ArrayRecord "arrays" carries parameters, and it only ever holds shared keys from the sites.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedst.experiment import ExperimentConfig, resolve_device
from fedst.federation.aggregation import make_strategy
from fedst.federation.run_io import RunLog
from fedst.federation.server import SERVER_CHECKPOINT, FederationServer
from fedst.metrics import METRIC_NAMES
from fedst.progress import progress_bar

log = logging.getLogger(__name__)


class FederationError(RuntimeError):
    """A site failed during a round; the message carries the site's own error text."""


def make_server_app(cfg: ExperimentConfig, run_dir: Path, progress: bool = True) -> ServerApp:
    """A ServerApp bound to one experiment (config comes from the entry point, not from Flower)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_federation(grid, cfg, run_dir, progress=progress)

    return app


def _broadcast(
    grid: Grid,
    nodes: list[int],
    kind: str,
    arrays: ArrayRecord,
    config: dict[str, Any],
    server_round: int,
) -> list[Message]:
    """Send the same arrays and config to every node and return the replies; a site's failure
    becomes a FederationError carrying the site's own error text."""
    messages = [
        Message(
            RecordDict({"arrays": arrays, "config": ConfigRecord(config)}),
            dst_node_id=node,
            message_type=kind,
            group_id=str(server_round),
        )
        for node in nodes
    ]
    replies = list(grid.send_and_receive(messages))
    errors = [r.error.reason for r in replies if r.has_error()]
    if errors:
        raise FederationError(
            f"{len(errors)} site(s) failed during {kind} of round {server_round}:\n"
            + "\n".join(errors)
        )
    if len(replies) != len(nodes):
        raise FederationError(
            f"{kind} round {server_round}: {len(replies)} of {len(nodes)} replies"
        )
    return replies


def _train_payload(server: FederationServer, cfg: ExperimentConfig, server_round: int) -> dict:
    """Round 1: the server's full initial model v_g^0; later: gamma_g (nothing without communication)."""
    if server_round == 1:
        return server.initial_payload()
    return server.shared_payload() if cfg.method.communicate else {}


def _log_training_reply(
    runlog: RunLog, reply: Message, down_sizes: dict[str, int], server_round: int, iterations: int
) -> None:
    """One comm row (``down_sizes`` measured once per round) and one train row per reply."""
    site, up, metrics = _site_of(reply), reply.content["arrays"], reply.content["metrics"]
    runlog.write(
        "comm",
        {
            "round": server_round,
            "site": site,
            **down_sizes,
            "upload_bytes": up.count_bytes(),
            "upload_param_bytes": _param_bytes(up),
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
        },
    )


def _site_of(reply: Message) -> str:
    return str(reply.content["site"]["site"])


def run_federation(
    grid: Grid, cfg: ExperimentConfig, run_dir: Path, progress: bool = True
) -> dict[str, Any]:
    """Run (or resume) the federation described by ``cfg``; returns the last per-site test metrics."""
    device = resolve_device(cfg.train.device)
    server = FederationServer(cfg, run_dir, device, progress=progress)
    runlog = RunLog(run_dir)
    last_metrics: dict[str, Any] = {}
    if (run_dir / SERVER_CHECKPOINT).exists():
        last_metrics = server.load().get("last_metrics", {})
        runlog.truncate_after(server.completed_round)
        log.info("resuming %s after round %d", run_dir, server.completed_round)
    else:
        pre_loss = server.initialize()
        if pre_loss is not None:
            runlog.write("train", {"round": 0, "site": "server", "serq_pretrain_loss": pre_loss})
        server.save(0)

    strategy = make_strategy(cfg.method.aggregation, cfg.method.aggregation_weights)
    nodes = sorted(grid.get_node_ids())
    if len(nodes) != len(cfg.data.federation):
        raise FederationError(
            f"{len(nodes)} nodes connected, the federation has {len(cfg.data.federation)} sites"
        )
    base_config = {
        "experiment": cfg.to_json(),
        "run-dir": str(run_dir),
        "local-iters": cfg.train.local_iters,
        "progress": progress,
    }

    rounds = range(server.completed_round + 1, cfg.train.rounds + 1)
    for server_round in progress_bar(
        rounds,
        desc=f"{cfg.method.name} rounds",
        enabled=progress,
        initial=server.completed_round,
        total=cfg.train.rounds,
    ):
        started = time.perf_counter()
        # -- local training at every site (Algorithm 1, lines 5-7) ------------------------------
        config = {**base_config, "server-round": server_round}
        down = ArrayRecord(_train_payload(server, cfg, server_round))
        replies = _broadcast(grid, nodes, MessageType.TRAIN, down, config, server_round)
        down_sizes = {
            "download_bytes": down.count_bytes(),
            "download_param_bytes": _param_bytes(down),
        }
        for reply in replies:
            _log_training_reply(runlog, reply, down_sizes, server_round, cfg.train.local_iters)
        # -- aggregation + server step (lines 8-12) -------------------------------------------------
        if cfg.method.communicate:
            step_started = time.perf_counter()
            aggregated, _ = strategy.aggregate_train(server_round, replies)
            aggregation_seconds = time.perf_counter() - step_started
            stats = server.server_step(
                aggregated.to_torch_state_dict() if aggregated else {}, server_round
            )
            runlog.write(
                "train",
                {
                    "round": server_round,
                    "site": "server",
                    "aggregation_seconds": aggregation_seconds,
                    "seconds": time.perf_counter() - step_started,  # aggregation + server step
                    **(vars(stats) if stats is not None else {}),
                },
            )
        # -- evaluation of the personalized models ---------------------------------------------
        if server_round % cfg.train.eval_every == 0 or server_round == cfg.train.rounds:
            shared = ArrayRecord(server.shared_payload() if cfg.method.communicate else {})
            replies = _broadcast(grid, nodes, MessageType.EVALUATE, shared, config, server_round)
            for reply in replies:
                row = _metrics_row(reply, server_round)
                runlog.write("metrics", row)
                last_metrics[row["site"]] = row
        server.save(server_round, extra={"last_metrics": last_metrics})
        log.info(  # the one line per round of a non-terminal log (fedst/progress.py)
            "round %d/%d done in %.1f s",
            server_round,
            cfg.train.rounds,
            time.perf_counter() - started,
        )
    runlog.close()
    return last_metrics


def _param_bytes(record: ArrayRecord) -> int:
    """Bytes of the parameter values alone (numel x element size), the paper's Table IX measure."""
    return int(sum(array.numpy().nbytes for array in record.values()))


def _metrics_row(reply: Message, server_round: int) -> dict[str, Any]:
    """One metrics.jsonl row from an evaluate reply, in the layout of SegmentationMeter.summary():
    a metric the reply leaves out (not scored: the class was absent from ground truth and
    prediction in every evaluated frame) is ``None`` (JSON null), never a number."""
    metrics = dict(reply.content["metrics"])
    per_class: dict[str, dict[str, float | int | None]] = {}
    for key in [k for k in metrics if "/" in k]:
        class_name, metric = key.split("/", 1)
        per_class.setdefault(class_name, {})[metric] = metrics.pop(key)
    for values in per_class.values():
        values["frames"] = int(values.get("frames", 0))
        values.update({m: float(values[m]) if m in values else None for m in METRIC_NAMES})
    return {
        "round": server_round,
        "site": _site_of(reply),
        "split": "test",
        "model": "personal",
        "num_frames": int(metrics.pop("num-examples")),
        **{m: float(metrics[m]) if m in metrics else None for m in METRIC_NAMES},
        "per_class": per_class,
    }
