"""``run_training``: one federation from a typed config to a finished run directory.

train_fed.py (Hydra CLI), the demo and the tests all call this, so they share one path:
engine (in-process Grid or Flower's Ray simulation) -> ServerApp/ClientApp rounds ->
out-of-federation evaluation -> final.json, tables and plots.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, RecordDict
from omegaconf import OmegaConf

from fedst.accel import (
    DeviceFacts,
    configure_device,
    cuda_unavailable_reason,
    device_facts,
    resolve_precision,
)
from fedst.app.client_app import app as client_app
from fedst.app.client_app import make_client_app, release_sites
from fedst.app.inprocess import InProcessGrid
from fedst.app.nodes import site_node_config
from fedst.app.ray_affinity import site_affinity
from fedst.app.server_app import make_server_app
from fedst.cli import console_held_while_setting_up
from fedst.config import ConfigError
from fedst.data.clips import resolve_num_workers, usable_cpu_count
from fedst.data.procedural import SITES, generate
from fedst.data.site_checks import validate_experiment_data
from fedst.experiment import ENGINES, ExperimentConfig, RayConfig, Runtime, run_device
from fedst.federation.state_writer import wait_for_state_writes
from fedst.report import plots, results, tables
from fedst.runs import Run
from fedst.runs.files import unfinished
from fedst.runs.final import write_final
from fedst.runs.footprint import keep_models_only
from fedst.runs.layout import (
    BENCHMARK_JSON,
    CONFIG_JSON,
    CONFIG_YAML,
    DEVICE_JSONL,
    IID_PARTITION_JSON,
    site_state_dir,
)
from fedst.storage import atomic_write_text

log = logging.getLogger(__name__)


def save_config(cfg: ExperimentConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    values = json.loads(cfg.to_json())
    atomic_write_text(json.dumps(values, indent=2), run_dir / CONFIG_JSON)
    atomic_write_text(OmegaConf.to_yaml(OmegaConf.create(values)), run_dir / CONFIG_YAML)


def prepare_data(
    cfg: ExperimentConfig, progress: bool = False, regenerate: bool = False
) -> dict[str, Any] | None:
    """The embedded benchmark (``data.procedural``) is generated where its site folders are absent
    (real data never is); a generated site that differs from the config stops the run
    (``regenerate``: rewrite it on purpose). Returns which benchmark it is (None for real data)."""
    if cfg.data.procedural is None:
        return None
    return prepare_benchmark(cfg, regenerate=regenerate, progress=progress)


def prepare_run(
    cfg: ExperimentConfig,
    run_dir: Path,
    progress: bool = False,
    regenerate: bool = False,
    federated_data: bool = True,
) -> None:
    """Every engine's start: the resolved config and the benchmark record in the run directory,
    data in place, and every site the run uses validated before anything trains.
    ``federated_data=False`` (the deployed server): the federated sites' data is at the
    hospitals, each site validates its own; the server validates only what it reads itself.
    Before anything is written, the server's device is resolved (a GPU-sized config that finds no
    GPU stops here, fedst.experiment.run_device) and set up, and its facts logged and appended to
    ``device.jsonl`` (:func:`record_device`). Its log lines reach the console once it passes
    (fedst.cli.console_held_while_setting_up)."""
    with console_held_while_setting_up():  # a set-up error prints its one line, nothing before
        record_device(cfg, run_dir)
        save_config(cfg, run_dir)
        record = prepare_data(cfg, progress, regenerate)
        if record is not None:
            benchmark = json.dumps(record, indent=2, sort_keys=True)
            atomic_write_text(benchmark, run_dir / BENCHMARK_JSON)
        iid = cfg.data.build_iid()  # data.partition=iid: the pooled-then-resplit control, once
        if iid is not None:
            iid_split = json.dumps(iid, indent=1, sort_keys=True)
            atomic_write_text(iid_split, run_dir / IID_PARTITION_JSON)
        validate_data(cfg, federated=federated_data)


"""In a run directory: one row per start (and resume) of the server process, the
:class:`fedst.accel.DeviceFacts` it computed with, with the time it started."""


def record_device(cfg: ExperimentConfig, run_dir: Path) -> DeviceFacts:
    """Resolve and set up this process's device for ``cfg`` (fedst.accel.configure_device),
    log its facts in one line and append them to ``<run_dir>/device.jsonl``; returns them."""
    device = run_device(cfg)
    train = cfg.train
    configure_device(
        device,
        tf32=train.tf32,
        cudnn_benchmark=train.cudnn_benchmark,
        deterministic=train.deterministic,
    )
    facts = device_facts(device, resolve_precision(train.amp_dtype, device), train.compile)
    log.info("run %s: %s", run_dir.name, facts.line())
    run_dir.mkdir(parents=True, exist_ok=True)
    row = {"started": datetime.now(UTC).isoformat(timespec="seconds"), "role": "server"}
    with open(run_dir / DEVICE_JSONL, "a") as rows:
        rows.write(json.dumps({**row, **dataclasses.asdict(facts)}, sort_keys=True) + "\n")
    return facts


def ray_client_resources(
    ray: RayConfig, num_sites: int, gpu_count: int | None = None, cpu_count: int | None = None
) -> dict[str, float]:
    """Flower's ``client_resources`` of every site actor: ``{"num_cpus", "num_gpus"}``.

    "auto" CPU share: ``max(1, cpu_count // num_sites)``; "auto" GPU share:
    ``min(1, gpu_count / num_sites)`` (0 without a GPU). ``gpu_count`` / ``cpu_count`` default to
    ``torch.cuda.device_count()`` and the usable CPU cores of this process.
    """
    if num_sites < 1:
        raise ValueError(f"ray_client_resources: num_sites={num_sites}, need at least one site")
    if cpu_count is None:
        cpu_count = usable_cpu_count()
    if gpu_count is None:
        gpu_count = torch.cuda.device_count()
    cpus = ray.num_cpus_per_site
    if cpus == "auto":
        cpus = max(1, cpu_count // num_sites)
    gpus = ray.num_gpus_per_site
    if gpus == "auto":
        gpus = min(1.0, gpu_count / num_sites)
    elif gpus > 0 and gpu_count == 0 and ray.address is None:  # Ray would wait forever
        raise ConfigError(
            f"ray.num_gpus_per_site={gpus} but torch sees no CUDA GPU here "
            f"({cuda_unavailable_reason()}): no site actor could start; set "
            "ray.num_gpus_per_site=0 (or auto) to train the sites on the CPU"
        )
    return {"num_cpus": float(cpus), "num_gpus": float(gpus)}


def check_resumable(run_dir: Path) -> None:
    """``train_fed.py resume=<run_dir>``: a finished run (:func:`fedst.runs.files.unfinished`:
    the end of its training wrote final.json) has nothing left to train, so resuming it is a
    ConfigError naming what to do instead, raised before anything is written
    (:func:`run_training` would append to its device.jsonl and rewrite final.json, tables and
    plots). Refused rather than exit 0: the command cannot do what it asks for (train), a
    script that resumes runs learns which one was already done, and the entry point's error
    boundary removes the run directory Hydra made for the command. A run whose final.json an
    evaluation wrote before its training ended is resumable; its end rewrites that file."""
    if unfinished(run_dir) is None:
        raise ConfigError(
            f"resume={run_dir}: the run is finished (it has final.json), nothing is left to "
            f"train; evaluate it with python eval_outfed.py run={run_dir}, or start a new run "
            "without resume="
        )


def require_ray() -> None:
    """``engine=ray`` needs Ray, which only Flower's ``simulation`` extra installs: without it,
    Flower's simulation would stop with its own exit code 701 and advice about an app's
    pyproject.toml, so the missing package is a ConfigError naming this project's install
    command instead."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "engine=ray needs Ray (Flower's simulation extra), which is not installed: run "
            ".venv/bin/pip install -e '.[simulation]' in this checkout, or use engine=inprocess"
        )


def run_training(
    cfg: ExperimentConfig,
    run_dir: Path,
    engine: str = Runtime.engine,
    progress: bool = Runtime.progress,
    regenerate: bool = Runtime.regenerate,
    ray: RayConfig | None = None,
) -> dict[str, Any]:
    """Train (or resume, when ``run_dir`` already holds a checkpoint) and finalize the run.
    ``engine``, ``progress``, ``regenerate``: as :class:`fedst.experiment.Runtime` (its defaults);
    ``ray``: the site actors' CPU / GPU shares of ``engine="ray"`` (None: the defaults)."""
    if engine not in ENGINES:  # before anything is written
        raise ConfigError(f"engine={engine!r}: choose one of {', '.join(ENGINES)}")
    if engine == "ray":
        require_ray()
    prepare_run(cfg, run_dir, progress, regenerate)
    # where the run writes, once its setup passed (a setup error removes the folder, fedst/cli.py)
    log.info("run directory: %s", run_dir.absolute())
    run = Run(run_dir, cfg)
    server_app = make_server_app(cfg, run_dir, progress=progress)
    parties = run.method.training_sites()  # the federated sites (upper bound: its pool)
    num_sites = len(parties)
    # each site's own settings (data folder, state folder, hardware) travel as node config, as
    # on a hospital's SuperNode; the messages carry no path
    nodes = [
        site_node_config(
            cfg,
            site,
            progress=progress,
            method=run.method,
            run_state_dir=str(site_state_dir(run_dir, site)),
        ).to_node_config()
        for site in parties
    ]
    if engine == "inprocess":
        grid = InProcessGrid(client_app, nodes)
        try:
            server_app(
                grid,
                Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
            )
        finally:
            release_sites()  # the sites' models, optimizers and data of this run
            wait_for_state_writes(
                under=run_dir
            )  # its sites' last states are on disk before anyone reads
    else:  # ray
        from flwr.simulation import run_simulation

        ray = ray or RayConfig()
        resources = ray_client_resources(ray, num_sites)
        if cfg.train.num_workers == "auto":  # actors load at once: each gets its CPU share
            workers = resolve_num_workers("auto", cpu_count=int(resources["num_cpus"]))
            nodes = [{**node, "num-workers": workers} for node in nodes]
        log.info(
            "Ray: each site actor reserves %s and keeps %s built site(s) (ray.sites_per_actor)",
            resources,
            ray.sites_per_actor,
        )
        with site_affinity(ray.site_affinity):
            run_simulation(
                server_app=server_app,
                client_app=make_client_app(nodes, sites_per_actor=ray.site_limit),
                num_supernodes=num_sites,
                backend_config={
                    "client_resources": resources,
                    # ray.init's arguments: a running cluster's address (None: start one here)
                    **({"init_args": {"address": ray.address}} if ray.address else {}),
                },
            )
    final = finalize_run(run, progress=progress)
    if not cfg.train.keep_resume_state:  # finished: never resumed (fedst/runs/footprint.py)
        keep_models_only(run)
    return final


def validate_data(cfg: ExperimentConfig, federated: bool = True) -> None:
    """Validate every site the run uses (federation unless ``federated=False``,
    out-of-federation, the server's set when SERQ runs) before anything trains; one DataError
    lists every problem (cached once passed)."""
    data = cfg.data
    sites = [*(data.federation if federated else ()), *data.out_of_federation]
    if cfg.method.synthetic_pretraining and data.server:  # the server's pre-training and SERQ set
        sites.append(data.server)
    if not sites:  # a deployed server without SERQ or out-of-federation sites reads no data
        return
    started = time.perf_counter()
    validate_experiment_data(data, cfg.clip_config(), sites)
    log.info("data of %d site(s) validated in %.1f s", len(sites), time.perf_counter() - started)


BENCHMARK_SEED = 0
"""Seed of the embedded procedural benchmark (one fixed benchmark; the run's seed varies training)."""


def prepare_benchmark(
    cfg: ExperimentConfig, regenerate: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Generate the configured procedural benchmark where absent; returns which one it is (seed,
    preset, generator version per site), what ``<run>/benchmark.json`` records."""
    root = Path(cfg.data.root or ".")
    version = cfg.data.generator_version
    generate(
        root,
        BENCHMARK_SEED,
        str(cfg.data.procedural),
        force=regenerate,
        progress=progress,
        version=version,
    )
    return {
        "root": str(root),
        "seed": BENCHMARK_SEED,
        "preset": cfg.data.procedural,
        "generator_version": version,
        "sites": {n: json.loads((root / n / "meta.json").read_text())["generator"] for n in SITES},
    }


def finalize_run(
    run: Run,
    progress: bool = False,
    qualitative: int = 2,
    site_data: bool = True,
) -> dict[str, Any]:
    """final.json (fedst.runs.final.write_final: out-of-federation scores, selection on
    validation, communication, refused replies), then its tables (markdown + CSV) and plots.

    ``site_data=False`` (deployment): the server holds no federated site's data, so qualitative
    examples come from the out-of-federation sites only. Only the end of training calls it (and
    eval_outfed.py on a finished run). Returns final.json's content.
    """
    record = write_final(run, progress=progress, qualitative=qualitative, site_data=site_data)
    run_dir = run.dir
    runs = results.load_runs([run_dir])
    tables.write_tables(runs, run_dir / "tables")
    plots.plot_learning_curves(record.metrics, run_dir / "plots" / "learning_curves.png")
    plots.plot_communication(record.comm, run_dir / "plots" / "communication.png")
    plots.plot_serq(record.train, run_dir / "plots" / "serq.png")
    if record.examples:
        plots.qualitative_grid(record.examples, run_dir / "plots" / "qualitative.png")
    return record.final
