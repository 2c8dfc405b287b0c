"""Flower ClientApp: unpack the message, call :class:`fedst.federation.site.Site`, pack the reply.

The same app runs in-process, under Ray and on a hospital's SuperNode. What it needs comes from
two places that never mix:

* the message: the *site view* of the experiment (fedst.experiment.site_view: method, network
  and training hyper-parameters, site names and surgery types; no path of any site and nothing
  of the server's disk), the run's name, the round and the shared parameters;
* the node (``context.node_config``, typed as fedst.experiment.SiteNodeConfig): which site this
  is, its data folder and backend options, its state folder, device and workers.

Private state (rho_k, optimizer moments, data order) lives on the site's disk only, in
``<state-dir>/<run-name>/`` with a fingerprint of the configuration that produced it
(fedst.federation.site.claim_state_dir); ``context.state`` is not used, because a SuperNode keeps
it in memory and loses it on restart.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterator

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedst.accel import PhasePeaks, release_free_memory
from fedst.app import keys
from fedst.app.site_statistics import statistics_reply
from fedst.experiment import (
    ExperimentConfig,
    SiteNodeConfig,
    experiment_from_json,
    run_device,
)
from fedst.federation import transport
from fedst.federation.site import Site
from fedst.methods import PERSONAL_KEY_SEPARATOR, method_of, privacy
from fedst.scoring.evaluation import metrics_record
from fedst.scoring.metrics import METRIC_NAMES, SUMMARY_METRIC_NAMES

log = logging.getLogger(__name__)

app = ClientApp()

_SITES: OrderedDict[tuple[str, str, str], Site] = OrderedDict()
"""Live Site objects of this process, by (state dir, which names the run; site; config
fingerprint), least recently used first: the model, data and optimizer are built once per process,
not once per message (a deployed site runs every message in one process,
fedst.app.site_executor; the in-process engine runs every site in this process). State on disk
stays authoritative: a Site restores from it whenever its in-memory round is not the one asked
for, and a Site whose handler raised is dropped, so the next message rebuilds it from disk."""

_SITE_LIMIT: int | None = None
"""At most this many live Sites in this process (None: every site it has seen). Flower's Ray
engine sets it in each actor to ``ray.sites_per_actor`` (:func:`make_client_app`): an actor runs
whichever site's message comes next, so without a bound every actor would end up holding every
site."""

_PAUSE_IDLE_LOADERS = False
"""Stop the loader workers of this process's other Sites when one runs (Ray actors: a site that
comes back usually restores its data order from disk, which restarts its workers anyway)."""


def release_sites() -> None:
    """Drop this process's live Site objects (the in-process engine calls it when a run ends)."""
    while _SITES:
        _close(_SITES.popitem(last=False)[1])


def keep_live_sites(limit: int | None, pause_idle_loaders: bool = False) -> None:
    """Keep at most ``limit`` live Sites in this process (None: all), least recently used evicted
    first; an evicted site is rebuilt from its state on disk if it comes back. With
    ``pause_idle_loaders`` only the Site that runs a message keeps its loader workers."""
    global _SITE_LIMIT, _PAUSE_IDLE_LOADERS
    if limit is not None and limit < 1:
        raise ValueError(f"keep_live_sites: limit={limit}, need at least 1 (or None: all)")
    _SITE_LIMIT, _PAUSE_IDLE_LOADERS = limit, pause_idle_loaders
    _evict(keep=limit)


def _close(site: Site) -> None:
    """Stop ``site``'s loader workers (training and evaluation) now (its model and optimizer go
    with the last reference)."""
    site.close_loaders()


def _evict(keep: int | None) -> None:
    """Drop the least recently used Sites until at most ``keep`` remain (None: none dropped)."""
    if keep is None or len(_SITES) <= keep:
        return
    while len(_SITES) > keep:
        _, site = _SITES.popitem(last=False)
        log.info("site %s: released from process %d (ray.sites_per_actor)", site.name, os.getpid())
        _close(site)
    release_free_memory()


def _pause_other_loaders(active: Site) -> None:
    """In a Ray actor: stop the loader workers of this process's other live Sites.
    A site that comes back to this actor after another actor trained it restores its data order
    from disk, which restarts its workers anyway; so an actor keeps one site's workers, not one
    set per site it holds."""
    for site in _SITES.values():
        if site is not active:
            site.close_loaders()


def _node(context: Context) -> SiteNodeConfig:
    return SiteNodeConfig.from_node_config(dict(context.node_config))


def _site_name(view: ExperimentConfig, node: SiteNodeConfig) -> str:
    """The site this node is: its node config's ``site-name`` (the Site built for it checks that
    the method trains it), else the method's training party at ``partition-id``. No Method is
    built for a named site: a message builds none (the live Sites keep theirs)."""
    if node.site_name is not None:
        return node.site_name
    if node.partition_id is None:
        raise ValueError("node config names no site: set site-name (or partition-id)")
    return method_of(view).training_sites()[node.partition_id]  # upper bound: the pool


def _site_for(message: Message, context: Context) -> tuple[Site, ConfigRecord]:
    config = message.content[keys.CONFIG]
    view = experiment_from_json(str(config[keys.EXPERIMENT]))
    node = _node(context)
    name = _site_name(view, node)
    cfg = node.local_experiment(view, name)
    state_dir = node.private_state_dir(str(config[keys.RUN_NAME]), name)
    key = (str(state_dir), name, cfg.fingerprint())
    site = _SITES.get(key)
    if site is None:
        _evict(keep=None if _SITE_LIMIT is None else _SITE_LIMIT - 1)  # room before building
        started = time.perf_counter()
        site = Site(name, cfg, state_dir, run_device(cfg), progress=node.progress)
        log.info(
            "site %s: built in process %d in %.2f s (%d live site(s) here)",
            name,
            os.getpid(),
            time.perf_counter() - started,
            len(_SITES) + 1,
        )
        _SITES[key] = site
    _SITES.move_to_end(key)
    if _PAUSE_IDLE_LOADERS:
        _pause_other_loaders(site)
    return site, config


@contextlib.contextmanager
def _forget_on_error(site: Site) -> Iterator[None]:
    """Drop ``site`` from the cache if the handler fails half-way (its model or optimizer may be
    half-updated); the next message rebuilds it from its state on disk."""
    try:
        yield
    except BaseException:
        for key in [k for k, v in _SITES.items() if v is site]:
            del _SITES[key]
        raise


def _site_record(site: Site, config: ConfigRecord, **extra: int) -> ConfigRecord:
    """The reply's "site" record: the site's name and the round it answers (``config``'s)."""
    return ConfigRecord(
        {keys.SITE_NAME: site.name, keys.SITE_ROUND: int(config[keys.SERVER_ROUND]), **extra}
    )


def _received(site: Site, message: Message) -> dict:
    """gamma_g of a message in fp32 (round 1: the full initial model); every shared key of this
    site's method must be there (transport.WireFormatError otherwise)."""
    expected = site.partition.shared if site.method.communicates else ()
    return transport.unpack(message.content, keys.ARRAYS, expected)


@app.train()
def train(message: Message, context: Context) -> Message:
    """Local training (Site.train_round), reply gamma_k packed in ``comm.precision``. With
    client-side DP, Flower's clipping mod clips gamma_k against the shared part of what this
    site received, on one Array per tensor in fp32 (client DP needs comm.precision=fp32), and
    the clipped gamma_k is packed afterwards."""
    site, config = _site_for(message, context)
    received = _received(site, message)
    mod = privacy.client_mod(site.cfg.privacy)
    if mod is None:
        shared, metrics = _train(site, received, config)
        return _train_reply(message, site, shared, metrics, config)
    view = copy.copy(message)  # the mod's view: gamma as received, in reply order
    view.content = RecordDict(
        {
            keys.ARRAYS: ArrayRecord({k: received[k] for k in site.partition.shared}),
            keys.CONFIG: config,
        }
    )

    def unclipped(_view: Message, _context: Context) -> Message:
        shared, metrics = _train(site, received, config)
        content = RecordDict({keys.ARRAYS: ArrayRecord(shared), keys.METRICS: metrics})
        return Message(content, reply_to=message)

    clipped = mod(view, context, unclipped)
    if clipped.has_error():
        return clipped
    shared = clipped.content[keys.ARRAYS].to_torch_state_dict()
    return _train_reply(message, site, shared, clipped.content[keys.METRICS], config)


def _train(site: Site, received: dict, config: ConfigRecord) -> tuple[dict, MetricRecord]:
    """gamma_k after this round's local training, and the reply's metrics (with the GPU's peak
    allocated / reserved bytes during it, where the site computes on CUDA)."""
    peaks = PhasePeaks(rss=False)  # in-process the resident size is the whole job's: not sent
    built = not site.build_reported  # since the last train reply (an evaluate may have built it)
    site.build_reported = True
    with _forget_on_error(site), peaks.phase("train"):
        result = site.train_round(
            received,
            int(config[keys.SERVER_ROUND]),
            int(config[keys.LOCAL_ITERS]),
            keep_rounds=[int(r) for r in config.get(keys.KEEP_ROUNDS, [])],
        )
    release_free_memory()  # the step's freed activations, before the next site or message
    metrics = MetricRecord(
        {
            keys.NUM_EXAMPLES: result.num_examples,
            keys.TRAIN_LOSS: result.mean_loss,
            keys.SECONDS: result.seconds,
            keys.LOADER_SECONDS: result.loader_seconds,
            # where it ran: one process and one build per site when sites keep their Ray actor
            keys.PROCESS_ID: os.getpid(),
            keys.SITE_BUILT: int(built),
            keys.STATE_RESTORES: site.disk_restores - site.restores_reported,
            **peaks.reply_metrics("train"),
            **result.metrics,
        }
    )
    site.restores_reported = site.disk_restores
    return result.shared, metrics


def _train_reply(
    message: Message, site: Site, shared: dict, metrics: MetricRecord, config: ConfigRecord
) -> Message:
    """The train reply: gamma_k packed in the wire precision (transport.pack refuses a value
    the wire cannot carry), the metrics, the site's name, round and training data size."""
    packed = transport.pack(shared, site.cfg.comm.precision)
    record = _site_record(
        site,
        config,
        **{keys.DATA_SIZE: site.num_examples, keys.DATA_CHANGED: int(site.data_changed)},
    )
    content = RecordDict({**packed.records(keys.ARRAYS), keys.METRICS: metrics, keys.SITE: record})
    return Message(content, reply_to=message)


def evaluation_metrics(summary: dict) -> dict[str, int | float]:
    """A meter summary as MetricRecord values: "num-examples", the overall metrics and
    "<class>/<metric>" per class, plus "<class>/frames" (frames where the class was scored).

    A value that was not scored (``None`` in the summary: a class absent from ground truth and
    prediction in every evaluated frame) is left out, so it travels as absent, never as a number.
    """
    metrics: dict[str, int | float] = {keys.NUM_EXAMPLES: int(summary["num_frames"])}
    metrics.update({k: float(summary[k]) for k in SUMMARY_METRIC_NAMES if summary[k] is not None})
    for class_name, values in summary["per_class"].items():
        metrics[f"{class_name}/frames"] = int(values["frames"])
        metrics.update(
            {f"{class_name}/{k}": float(values[k]) for k in METRIC_NAMES if values[k] is not None}
        )
    return metrics


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    site, config = _site_for(message, context)
    received = transport.unpack(message.content)  # after a final stage: nothing
    with _forget_on_error(site):
        split = str(config[keys.SPLIT]) if keys.SPLIT in config else "test"
        results = site.evaluate(received, int(config[keys.SERVER_ROUND]), split=split)
    release_free_memory()
    records = {
        metrics_record(scored, site.name): MetricRecord(evaluation_metrics(result.summary))
        for scored, result in results.items()
    }
    content = RecordDict({**records, keys.SITE: _site_record(site, config)})
    return Message(content, reply_to=message)


@app.query(keys.PERSONAL_QUERY)
def export_personal(message: Message, context: Context) -> Message:
    """Once, after the last round: rho_k for the out-of-federation average, if this site allows it.

    With :func:`exchange_personal` the only messages that carry private parameters; a site whose
    node config says ``share-personal=false`` answers with its name and ``shared: 0`` instead.
    """
    return _personal_reply(message, context, "for the out-of-federation model", "fp32")


@app.query(keys.PERSONAL_EXCHANGE_QUERY)
def exchange_personal(message: Message, context: Context) -> Message:
    """Before a method's final stage that needs every site's model (FedDP's inter-site tuning):
    rho_k for the other sites, if this site allows it (``share-personal``) and its method asks
    for such an exchange (a site never sends rho_k only because a server asks for it)."""
    site, _ = _site_for(message, context)
    stage = site.method.final_stage()
    if stage is None or not stage.exchange_personal:
        raise ValueError(
            f"site {site.name}: method {site.method.name} exchanges no personalized parameters; "
            f"refusing query.personal_exchange"
        )
    purpose = f"for the other sites' {stage.name}"
    return _personal_reply(message, context, purpose, site.cfg.comm.precision)


def _personal_reply(message: Message, context: Context, purpose: str, precision: str) -> Message:
    """rho_k of the round in the message in the wire ``precision`` (or ``shared: 0`` when the
    node does not allow it)."""
    site, config = _site_for(message, context)
    server_round = int(config[keys.SERVER_ROUND])
    with _forget_on_error(site):
        site.restore(server_round)
    if not _node(context).share_personal:
        log.warning("site %s declines to send its personalized parameters %s", site.name, purpose)
        info = _site_record(site, config, **{keys.SHARED: 0})
        return Message(RecordDict({keys.SITE: info}), reply_to=message)
    personal = site.personal_state()
    log.warning(
        "site %s sends its personalized parameters (%d tensors) %s",
        site.name,
        len(personal),
        purpose,
    )
    content = RecordDict(
        {
            **transport.pack(personal, precision).records(keys.PERSONAL),
            keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: site.num_examples}),
            keys.SITE: _site_record(site, config, **{keys.SHARED: 1}),
        }
    )
    return Message(content, reply_to=message)


@app.train(keys.FINAL_STAGE_TRAIN)
def final_stage(message: Message, context: Context) -> Message:
    """After the last round: the method's final stage (Method.final_stage) from gamma_g
    ("arrays") and the rho_j of the other sites that shared theirs ("personal", keys
    "<site>/<key>"); nothing but scalars travels back."""
    site, config = _site_for(message, context)
    shared = _received(site, message)
    others: dict[str, dict] = {}
    if keys.PERSONAL in message.content:
        for key, value in transport.unpack(message.content, keys.PERSONAL).items():
            other, name = key.split(PERSONAL_KEY_SEPARATOR, 1)
            others.setdefault(other, {})[name] = value
    with _forget_on_error(site):
        result = site.final_stage(shared, others, int(config[keys.SERVER_ROUND]))
    metrics = MetricRecord(
        {
            keys.NUM_EXAMPLES: result.num_examples,
            keys.SECONDS: result.seconds,
            keys.ENSEMBLE_SIZE: 1 + len(others),
            **result.metrics,
        }
    )
    return Message(
        RecordDict({keys.METRICS: metrics, keys.SITE: _site_record(site, config)}),
        reply_to=message,
    )


@app.query(keys.STATS_QUERY)
def site_statistics(message: Message, context: Context) -> Message:
    """Once, at the start of a run: this site's data statistics (fedst/app/site_statistics.py);
    only numbers, read from the data without building the model."""
    config = message.content[keys.CONFIG]
    view = experiment_from_json(str(config[keys.EXPERIMENT]))
    node = _node(context)
    name = _site_name(view, node)
    return statistics_reply(message, node.local_experiment(view, name).data.open(name), name)


def make_client_app(local_nodes: list[dict], sites_per_actor: int | None = None) -> ClientApp:
    """The same handlers for Flower's Ray simulation, whose virtual nodes only carry
    ``partition-id``: each gets the node config of its site (``local_nodes[partition-id]``).

    Flower's Ray backend hands each message to whichever actor is idle
    (flwr/simulation/ray_transport/ray_actor.py, ``BasicActorPool.submit``), so a site keeps an
    actor only with ``ray.site_affinity`` (fedst/app/ray_affinity.py). Each actor keeps the last
    ``sites_per_actor`` sites it ran (None: all it has seen; ``ray.sites_per_actor``), and only
    the loader workers of the site it runs now: a site that comes back to an actor that holds it
    is not rebuilt, only restored from disk when another actor trained it since; one it does not
    hold is built (timed in the log)."""
    simulated = ClientApp()

    def with_node(handler):
        def call(message: Message, context: Context) -> Message:
            keep_live_sites(sites_per_actor, pause_idle_loaders=True)  # in the actor
            node = local_nodes[int(context.node_config["partition-id"])]
            context.node_config = {**context.node_config, **node}
            return handler(message, context)

        return call

    simulated.train()(with_node(train))
    simulated.evaluate()(with_node(evaluate))
    simulated.query(keys.PERSONAL_QUERY)(with_node(export_personal))
    simulated.query(keys.STATS_QUERY)(with_node(site_statistics))
    simulated.query(keys.PERSONAL_EXCHANGE_QUERY)(with_node(exchange_personal))
    simulated.train(keys.FINAL_STAGE_TRAIN)(with_node(final_stage))
    return simulated
