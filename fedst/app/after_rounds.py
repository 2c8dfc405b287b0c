"""What the ServerApp does after the last round: a method's final stage (logged as round T + 1:
with ``exchange_personal`` the sites' rho_k are collected and each site receives the others' in
``train.final_stage``; then every site scores its final model) and, in a deployment, the one
request for every site's rho_k for the out-of-federation average (personal_export.json)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from flwr.app import MessageType

from fedst.app import keys
from fedst.app.messaging import SiteGrid, site_of
from fedst.app.reply_logs import bytes_by_component, metrics_row
from fedst.federation import transport
from fedst.federation.server import FederationServer
from fedst.methods import PERSONAL_KEY_SEPARATOR, FinalStage
from fedst.runs.files import RunLog
from fedst.runs.layout import PERSONAL_EXPORT, site_state_dir, site_state_file
from fedst.storage import atomic_torch_save, atomic_write_text

log = logging.getLogger("fedst.app.server_app")  # the ServerApp's log, as before the split


def run_final_stage(
    sites: SiteGrid,
    server: FederationServer,
    stage: FinalStage,
    base_config: dict[str, Any],
    runlog: RunLog,
) -> dict[str, Any]:
    """The method's stage after the last round T, logged as round T + 1: (with
    ``exchange_personal``) collect rho_k from the sites that allow it and send each of them the
    others' rho_j, with gamma_g, in ``train.final_stage``; then every site scores its final model.
    comm.jsonl gets one row per site with ``kind`` = the stage's name. Returns the metrics rows."""
    last_round, stage_round = server.completed_round, server.completed_round + 1
    config = {**base_config, keys.SERVER_ROUND: stage_round}
    precision = server.cfg.comm.precision
    nothing = transport.pack({}, precision)
    personal: dict[str, transport.Packed] = {}
    if stage.exchange_personal:
        collected = sites.ask(
            keys.QUERY_PERSONAL_EXCHANGE,
            nothing,
            {**base_config, keys.SERVER_ROUND: last_round},
            stage_round,
            "personal exchange",
        )
        for reply in collected.replies:
            if int(reply.content[keys.SITE][keys.SHARED]):
                personal[site_of(reply)] = transport.received(reply.content, keys.PERSONAL)
            else:
                log.warning(
                    "site %s keeps its personalized parameters: not in %s",
                    site_of(reply),
                    stage.name,
                )
    records = {
        node: {keys.PERSONAL: _others_personal(personal, sites.sites_of[node], precision)}
        for node in sites.nodes
        if sites.sites_of.get(node) in personal
    }
    log.warning(
        "%s: personalized parameters of %s travel to the other sites that shared theirs",
        stage.name,
        sorted(personal) or "no site",
    )
    down = transport.pack(server.shared_payload(), precision)
    tuned = sites.ask(
        keys.TRAIN_FINAL_STAGE, down, config, stage_round, stage.name, records=records
    )
    node_of = {site: node for node, site in sites.sites_of.items()}
    for reply in tuned.replies:
        site, metrics = site_of(reply), reply.content[keys.METRICS]
        received = records.get(node_of[site], {}).get(keys.PERSONAL, nothing)
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
                "upload_param_bytes_by_component": bytes_by_component(sent),
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
                "iterations": int(metrics.get(keys.ITERATIONS, 0)),
                "ensemble_size": int(metrics[keys.ENSEMBLE_SIZE]),
                "loss": float(metrics.get(keys.TRAIN_LOSS, math.nan)),
                "seconds": float(metrics[keys.SECONDS]),
            },
        )
    evaluated = sites.ask(  # the sites' models are wholly their own now: nothing to send
        MessageType.EVALUATE, nothing, config, stage_round, "evaluate", nodes=sites.known_nodes()
    )
    last_metrics = {}
    for reply in evaluated.replies:
        row = metrics_row(reply, stage_round)
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


def collect_personal(
    sites: SiteGrid,
    base_config: dict[str, Any],
    last_round: int,
    run_dir: Path,
    last_shared: dict[str, dict],
) -> None:
    """Ask every site once for rho_k (the out-of-federation average); store what is sent in the
    run directory's site folders and write who sent and who declined to personal_export.json.

    With ``last_shared`` (method.returned_model=own) each stored state also gets the site's own
    gamma_k^T, taken from its reply of the last round (nothing more crosses the wire: the server
    received it then; under fp16 / bf16 transport it is the rounded gamma_k the site sent). A
    site that missed the last round has none: it is left out (``missed_last_round``)."""
    nodes = sorted(sites.grid.get_node_ids())
    config = {**base_config, keys.SERVER_ROUND: last_round}
    result = sites.ask(  # every node: a site that fails is recorded as unreachable, not fatal
        keys.QUERY_PERSONAL,
        transport.pack({}, "fp32"),
        config,
        last_round,
        "personal export",
        nodes=nodes,
        check=False,
    )
    shared, declined, missed = [], [], []
    for reply in result.replies:
        site = site_of(reply)
        if not int(reply.content[keys.SITE][keys.SHARED]):
            declined.append(site)
            log.warning("site %s declined to send its personalized parameters", site)
            continue
        personal = transport.unpack(reply.content, keys.PERSONAL)
        state = {
            "round": last_round,
            "site": site,
            "personal": personal,
            "num_examples": int(reply.content[keys.METRICS][keys.NUM_EXAMPLES]),
            "exported": True,
        }
        if last_shared:
            if last_shared.get(site, {}).get("round") != last_round:
                missed.append(site)
                log.warning("site %s sent no gamma_k in round %d: left out", site, last_round)
                continue
            state["shared"] = last_shared[site]["shared"]
        atomic_torch_save(state, site_state_file(site_state_dir(run_dir, site), last_round))
        shared.append(site)
        log.warning("site %s sent its personalized parameters (%d tensors)", site, len(personal))
    silent = [sites.sites_of.get(n, f"node {n}") for n in result.failed]
    export = {
        "round": last_round,
        "shared": sorted(shared),
        "declined": sorted(declined),
        "unreachable": sorted(silent),
        "missed_last_round": sorted(missed),
    }
    atomic_write_text(json.dumps(export, indent=1), run_dir / PERSONAL_EXPORT)
