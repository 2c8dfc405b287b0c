"""What the ServerApp writes to the run logs from the sites' replies: per training reply a
comm.jsonl row (bytes down and up, up per network component) and a train.jsonl row (loss, time,
update norm), and per evaluate reply the metrics.jsonl rows of every split it scored, in the layout
of SegmentationMeter.summary()."""

from __future__ import annotations

import re
from typing import Any

from flwr.app import Message

from fedst.accel import REPLY_MEMORY_KEYS
from fedst.app import keys
from fedst.app.messaging import site_of
from fedst.federation import transport
from fedst.model.partition import COMPONENTS
from fedst.runs.files import RunLog
from fedst.scoring.evaluation import METRICS_RECORD, scored_site
from fedst.scoring.metrics import METRIC_NAMES, SUMMARY_METRIC_NAMES


def log_training_reply(
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
    site, metrics = site_of(reply), reply.content[keys.METRICS]
    runlog.write(
        "comm",
        {
            "round": server_round,
            "site": site,
            **down_sizes,
            "upload_bytes": up.wire_bytes,
            "upload_param_bytes": up.param_bytes,
            "upload_param_bytes_by_component": bytes_by_component(up),
        },
    )
    runlog.write(
        "train",
        {
            "round": server_round,
            "site": site,
            "iterations": iterations,
            "loss": float(metrics[keys.TRAIN_LOSS]),
            "seconds": float(metrics[keys.SECONDS]),
            **(
                {"loader_seconds": float(metrics[keys.LOADER_SECONDS])}
                if keys.LOADER_SECONDS in metrics
                else {}
            ),
            "update_norm": update_norm,
            **{  # where it ran (absent from replies of older sites)
                row: int(metrics[key]) for key, row in PLACEMENT_KEYS.items() if key in metrics
            },
            # the site's GPU peaks during its round (absent: it computed on the CPU)
            **{row: int(metrics[key]) for key, row in REPLY_MEMORY_KEYS.items() if key in metrics},
        },
    )


PLACEMENT_KEYS = {
    keys.PROCESS_ID: "process",
    keys.SITE_BUILT: "site_built",
    keys.STATE_RESTORES: "state_restores",
}
"""Train-reply metrics -> train.jsonl fields telling where a site ran (tests/test_ray_engine.py
counts builds, restores and moves from them)."""


def bytes_by_component(packed: transport.Packed) -> dict[str, int]:
    """Parameter bytes of a payload per network component (fedst.model.partition.COMPONENTS),
    from its manifest (numel x element size of each tensor on the wire)."""
    sizes: dict[str, int] = {}
    for tensor in packed.tensors:
        name = next((c for c, p in COMPONENTS.items() if re.search(p, tensor.key)), "other")
        sizes[name] = sizes.get(name, 0) + tensor.nbytes
    return sizes


def metrics_rows(reply: Message, server_round: int, split: str = "test") -> list[dict[str, Any]]:
    """The metrics.jsonl rows of an evaluate reply: one per split it scored (its site's own;
    the upper bound's pool: every federated site's), each with the scored site as "site"."""
    party = site_of(reply)
    scored = {name: scored_site(name, party) for name in reply.content.metric_records}
    return [
        metrics_row(reply, server_round, record, site, split)
        for record, site in scored.items()
        if site is not None
    ]


def metrics_row(
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
        "site": site or site_of(reply),
        "split": split,
        "model": "personal",
        "num_frames": int(metrics.pop(keys.NUM_EXAMPLES)),
        **{m: float(metrics[m]) if m in metrics else None for m in SUMMARY_METRIC_NAMES},
        "per_class": per_class,
    }
