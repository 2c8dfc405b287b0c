"""The deployed ServerApp (``flwr run .``, pyproject.toml's ``serverapp``): it reads the run
config that ``train_fed.py site=server`` passes (fedst/deploy/superlink.py), prepares or resumes the run
directory, runs :func:`fedst.app.server_app.run_federation` over Flower's grid and finalizes the
run on the server."""

from __future__ import annotations

import datetime
import logging
import shlex
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedst.app.server_app import run_federation
from fedst.app.site_executor import exit_with_parent
from fedst.cli import compose_experiment, setup_logging
from fedst.experiment import DeployConfig
from fedst.runs import Run
from fedst.runs.files import load_config
from fedst.runs.footprint import keep_models_only
from fedst.training import finalize_run, prepare_run

log = logging.getLogger(__name__)

app = ServerApp()
"""The deployed ServerApp (``flwr run .``): config from the run config, see :func:`deployed_main`."""


@app.main()
def deployed_main(grid: Grid, context: Context) -> None:
    """Run the federation of ``run-dir`` (prepared by ``train_fed.py site=server``: config.json),
    or of the Hydra ``overrides`` when run-dir is empty, then finalize it on the server."""
    run_config_to_run(grid, dict(context.run_config))


def run_config_to_run(grid: Any, run_config: dict[str, Any]) -> None:
    """Body of the deployed ServerApp: train the run of ``run-dir`` (or of the Hydra ``overrides``
    in a new folder under ``runs``) over ``grid`` and finalize it on the server."""
    # the SuperLink starts flower-superexec (our parent) in a session of its own, so a killed
    # server does not take this process with it, and Flower's own exit on SIGINT waits minutes
    # for its connection retries: end as soon as the SuperExec is gone
    exit_with_parent()

    if str(run_config.get("run-dir", "")):
        run_dir = Path(str(run_config["run-dir"]))
        cfg = load_config(run_dir)
    else:
        cfg, _ = compose_experiment(shlex.split(str(run_config.get("overrides", ""))))
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(str(run_config.get("runs", "runs"))) / cfg.name
        run_dir = run_dir / f"{cfg.method.name}_s{cfg.seed}_{stamp}"
        prepare_run(cfg, run_dir, progress=False, federated_data=False)
    setup_logging(run_dir)
    policy = DeployConfig.from_run_config(run_config).policy()  # the one codec, its defaults
    log.info("deployed run %s", run_dir)
    run_federation(grid, cfg, run_dir, progress=False, policy=policy)
    run = Run(run_dir, cfg)
    finalize_run(run, site_data=False)
    if not cfg.train.keep_resume_state:  # finished: never resumed (fedst/runs/footprint.py)
        keep_models_only(run)
