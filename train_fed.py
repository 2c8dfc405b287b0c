"""Train a federation: FedST (default), an ablation or a baseline, on any configured data.

    python train_fed.py                                   # FedST, demo experiment, sites A-D in-process
    python train_fed.py method=fedavg
    python train_fed.py +ablation=table4_row2_ts seed=1
    python train_fed.py experiment=paper data=paper       # the paper's settings on the real datasets
    python train_fed.py -m seed=0,1,2                     # several seeds; then python -m fedst.report <sweep dir>
    python train_fed.py resume=runs/demo/fedst_s0_...      # continue an interrupted run
    python train_fed.py resume=runs/... train.device=cpu  # on resume only train.eval_every,
                                                          # train.device, train.num_workers,
                                                          # progress, engine may change

Configs: configs/ (see configs/config.yaml). The run directory layout: fedst/federation/run_io.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fedst import report
from fedst.cli import register_resolvers, resume_experiment, setup_logging, split_config
from fedst.training import load_config, run_training

register_resolvers()
log = logging.getLogger("train_fed")


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    experiment, runtime = split_config(cfg)
    if runtime.get("resume"):
        run_dir = Path(runtime["resume"])
        setup_logging(run_dir)
        # the interrupted run's own config, changed only by the overrides safe on resume
        overrides = list(HydraConfig.get().overrides.task)
        experiment = resume_experiment(load_config(run_dir), experiment, overrides)
    else:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        setup_logging(run_dir)
    log.info("run directory: %s", run_dir)
    run_training(
        experiment,
        run_dir,
        engine=runtime["engine"],
        progress=runtime["progress"],
        regenerate=runtime["regenerate"],
    )
    print(report.comparison_table(report.load_runs([run_dir])).to_markdown())
    print(f"run directory: {run_dir}")


if __name__ == "__main__":
    main()
