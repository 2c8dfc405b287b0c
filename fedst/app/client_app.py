"""Flower ClientApp: unpack the message, call :class:`fedst.federation.site.Site`, pack the reply.

The same app runs in-process, under Ray and on a hospital's SuperNode. What it needs comes from
the message (the experiment config, the round, the shared parameters) and from the node
(``node_config``: ``site-name`` or ``partition-id``; optionally ``data-path`` and ``state-dir``).
Private state: rho_k stays in ``context.state["personal"]`` and in the site's state folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedst.experiment import ExperimentConfig, experiment_from_json, resolve_device, site_state_dir
from fedst.federation.aggregation import UNIFORM_WEIGHT_KEY
from fedst.federation.components import state_subset
from fedst.federation.site import Site
from fedst.metrics import METRIC_NAMES

app = ClientApp()

_SITES: dict[tuple[str, str, str], Site] = {}
"""Live Site objects of this process, by (run dir, site, config fingerprint): the model, data and
optimizer are built once per process, not once per message. State on disk stays authoritative."""


def release_sites() -> None:
    """Drop this process's live Site objects (the in-process engine calls it when a run ends)."""
    _SITES.clear()


def _site_name(cfg: ExperimentConfig, context: Context) -> str:
    if "site-name" in context.node_config:
        return str(context.node_config["site-name"])
    return cfg.data.federation[int(context.node_config["partition-id"])]


def _site_for(message: Message, context: Context) -> tuple[Site, ConfigRecord]:
    config = message.content["config"]
    cfg = experiment_from_json(str(config["experiment"]))
    name = _site_name(cfg, context)
    if "data-path" in context.node_config:  # deployment: the hospital's own copy of its data
        spec = dataclasses.replace(cfg.data.sites[name], root=str(context.node_config["data-path"]))
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, sites={**cfg.data.sites, name: spec})
        )
    run_dir = Path(str(config["run-dir"]))
    state_dir = Path(str(context.node_config.get("state-dir", site_state_dir(run_dir, name))))
    key = (str(state_dir), name, cfg.fingerprint())
    if key not in _SITES:
        _SITES[key] = Site(
            name,
            cfg,
            state_dir,
            resolve_device(cfg.train.device),
            progress=bool(config.get("progress", False)),
        )
    return _SITES[key], config


@app.train()
def train(message: Message, context: Context) -> Message:
    site, config = _site_for(message, context)
    received = message.content["arrays"].to_torch_state_dict()
    result = site.train_round(received, int(config["server-round"]), int(config["local-iters"]))
    context.state["personal"] = ArrayRecord(state_subset(site.model, site.partition.personal))
    metrics = MetricRecord(
        {
            "num-examples": result.num_examples,
            UNIFORM_WEIGHT_KEY: 1,
            "train-loss": result.mean_loss,
            "seconds": result.seconds,
        }
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord(result.shared),
            "metrics": metrics,
            "site": ConfigRecord({"site": site.name}),
        }
    )
    return Message(content, reply_to=message)


def evaluation_metrics(summary: dict) -> dict[str, int | float]:
    """A meter summary as MetricRecord values: "num-examples", the overall metrics and
    "<class>/<metric>" per class, plus "<class>/frames" (frames where the class was scored).

    A value that was not scored (``None`` in the summary: a class absent from ground truth and
    prediction in every evaluated frame) is left out, so it travels as absent, never as a number.
    """
    metrics: dict[str, int | float] = {"num-examples": int(summary["num_frames"])}
    metrics.update({k: float(summary[k]) for k in METRIC_NAMES if summary[k] is not None})
    for class_name, values in summary["per_class"].items():
        metrics[f"{class_name}/frames"] = int(values["frames"])
        metrics.update(
            {f"{class_name}/{k}": float(values[k]) for k in METRIC_NAMES if values[k] is not None}
        )
    return metrics


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    site, config = _site_for(message, context)
    received = message.content["arrays"].to_torch_state_dict()
    result = site.evaluate(received, int(config["server-round"]))
    content = RecordDict(
        {
            "metrics": MetricRecord(evaluation_metrics(result.summary)),
            "site": ConfigRecord({"site": site.name}),
        }
    )
    return Message(content, reply_to=message)
