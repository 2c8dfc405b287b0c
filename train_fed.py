"""Train a federation: FedST (default), an ablation or a baseline, on any configured data.

    python train_fed.py                                   # FedST, demo experiment, sites A-D in-process
    python train_fed.py method=fedavg
    python train_fed.py +ablation=table4_row2_ts seed=1
    python train_fed.py experiment=paper data=paper       # the paper's settings on the real datasets
    python train_fed.py -m seed=0,1,2                     # several seeds; then python -m fedst.report <sweep dir>
    python train_fed.py resume=runs/demo/fedst_s0_...      # continue an interrupted run
    python train_fed.py engine=ray ray.num_gpus_per_site=0.25  # four sites per GPU (default
                                                          # "auto": GPUs / sites, fedst/experiment/runtime.py
                                                          # RayConfig)
    python train_fed.py resume=runs/... train.device=cpu  # on resume only train.eval_every,
                                                          # train.device, train.num_workers,
                                                          # progress, engine may change

Across hospitals (Flower's deployment engine, docs/deployment.md):

    python train_fed.py site=server [experiment=...] deploy.certs=certs deploy.keys=keys
    python train_fed.py site=A data=paper data.sites.A.root=/their/path \
        deploy.server=<host>:9092 deploy.certs=certs deploy.keys=keys deploy.state_dir=/var/fedst
    python -m fedst.deploy local --sites A B C D experiment=tiny   # all of it on 127.0.0.1

Site options (the server never sends them): data.sites.<site>.root, train.device,
train.num_workers, deploy.state_dir, deploy.share_personal, deploy.site_port, deploy.server,
deploy.certs, deploy.keys, deploy.connect_timeout, deploy.executor_poll. Server options:
deploy.host, deploy.port, deploy.min_sites, deploy.round_timeout, deploy.eval_timeout,
deploy.join_timeout, deploy.reply_poll. Both: deploy.transfers_in_flight, deploy.chunk_mib. All: fedst/experiment/runtime.py
DeployConfig.

Configs: configs/ (see configs/config.yaml). The run directory layout: fedst/runs/layout.py.
A mistake (an unknown key, a wrong value, a missing run) ends in one line and exit status 2
(FEDST_DEBUG=1: with its traceback); a command that fails before its first round ended leaves
no run directory behind (fedst/cli.py remove_unfinished_runs).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fedst.cli import (
    TRAIN_KEYS_LISTED,
    check_method,
    existing_run,
    hydra_job,
    register_resolvers,
    remove_unfinished_runs,
    resume_experiment,
    run_hydra_entry_point,
    setup_logging,
    split_config,
)
from fedst.config import ConfigError
from fedst.experiment import ExperimentConfig, Runtime

register_resolvers()
log = logging.getLogger("train_fed")

STARTED_RUNS: list[Path] = []
"""The run directories this process trained in (a sweep: several), for :func:`resume_hint`."""


def resume_hint() -> str:
    """After Ctrl-C: how to continue the last run started, when it kept a checkpoint (a run
    stopped before one is removed, fedst/cli.py remove_unfinished_runs)."""
    from fedst.runs.layout import SERVER_CHECKPOINT

    kept = [run_dir for run_dir in STARTED_RUNS if (run_dir / SERVER_CHECKPOINT).is_file()]
    return f"; continue it: python train_fed.py resume={kept[-1]}" if kept else ""


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with hydra_job():  # a failure is raised by run_hydra_entry_point, in one line
        train(cfg)


def train(cfg: DictConfig) -> None:
    """Train (or resume, or deploy) the experiment Hydra composed."""
    experiment, runtime = split_config(cfg)
    check_method(experiment)
    # the engines, imported once the config is right (a mistake ends sooner)
    from fedst.report import results, tables
    from fedst.runs.files import load_config
    from fedst.training import check_resumable, run_training

    if runtime.resume:
        run_dir = existing_run(runtime.resume, "resume")  # before anything is written there
        check_resumable(run_dir)  # a finished run: nothing to resume
        setup_logging(run_dir)
        # the interrupted run's own config, changed only by the overrides safe on resume
        overrides = list(HydraConfig.get().overrides.task)
        experiment = resume_experiment(load_config(run_dir), experiment, overrides)
    else:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
    if runtime.site is not None:
        sys.exit(deploy(experiment, run_dir, runtime))
    setup_logging(run_dir)
    STARTED_RUNS.append(run_dir)
    run_training(
        experiment,
        run_dir,
        engine=runtime.engine,
        progress=runtime.progress,
        regenerate=runtime.regenerate,
        ray=runtime.ray,
    )
    if runtime.resume:  # the resumed run wrote into its own folder, not Hydra's new one
        remove_unfinished_runs()
    print(tables.comparison_table(results.load_runs([run_dir])).to_markdown())
    print(f"run directory: {run_dir}")


def deploy(experiment: ExperimentConfig, run_dir: Path, runtime: Runtime) -> int:
    """site=server: the coordinating server; site=<name>: that hospital's SuperNode. Problems a
    user can fix (address, certificate, key, data folder) end in one line naming the fix."""
    from fedst import deploy as deployment
    from fedst.report import results, tables

    site, dcfg = str(runtime.site), runtime.deploy
    try:
        with deployment.terminate_on_signal():
            if site == "server":
                setup_logging(run_dir)
                deployment.serve(experiment, run_dir, dcfg)
                print(tables.comparison_table(results.load_runs([run_dir])).to_markdown())
                print(f"run directory: {run_dir}")
                return 0
            setup_logging()
            return deployment.serve_site(experiment, site, dcfg, progress=runtime.progress)
    except (deployment.DeploymentError, ConfigError) as err:
        log.error("%s", err)
        return 2


if __name__ == "__main__":
    run_hydra_entry_point(
        main, "train_fed.py", "config", TRAIN_KEYS_LISTED, after_interrupt=resume_hint
    )
