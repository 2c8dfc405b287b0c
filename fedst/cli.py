"""Shared plumbing of the Hydra entry points (train_fed.py, eval_outfed.py)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedst.config import to_dict
from fedst.experiment import DeployConfig, ExperimentConfig, experiment_from_dict

RUNTIME_KEYS = ("engine", "resume", "progress", "site", "deploy")
"""Top-level keys that steer the entry point, not the experiment."""


DEFAULTS_NODE = "fedst_defaults"


def register_resolvers() -> None:
    """Prepare Hydra for our configs (idempotent).

    * ``${fedst.div:a,b}`` = a // b (rounds = total_iters // local_iters in experiment configs).
    * ``fedst_defaults``: every field of the typed configs (fedst/experiment.py and the dataclasses
      it holds) with its dataclass default, stored in Hydra's ConfigStore and listed first in
      configs/config.yaml. Defaults are thus defined once, in code, and every key can be
      overridden from the command line (``method.serq=false``) while a typo is still an error.
    """
    if not OmegaConf.has_resolver("fedst.div"):
        OmegaConf.register_new_resolver("fedst.div", lambda a, b: int(a) // int(b))
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=DEFAULTS_NODE, node=_experiment_defaults())


def _experiment_defaults() -> dict[str, Any]:
    """Defaults of every ExperimentConfig field except ``data`` (which has none)."""
    values = {}
    for item in dataclasses.fields(ExperimentConfig):
        if item.name == "data":
            continue
        default = (
            item.default_factory()
            if item.default_factory is not dataclasses.MISSING
            else item.default
        )
        values[item.name] = to_dict(default)
    values["deploy"] = to_dict(DeployConfig())  # train_fed.py site=...: fedst/deploy.py
    return values


def split_config(cfg: DictConfig) -> tuple[ExperimentConfig, dict[str, Any]]:
    """Resolve the Hydra config into (typed experiment, runtime options)."""
    values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(values, dict)
    values.pop("hydra", None)
    runtime = {k: values.pop(k) for k in RUNTIME_KEYS if k in values}
    return experiment_from_dict(values), runtime


def setup_logging(run_dir: Path | None = None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(run_dir / "log.txt"))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        handlers=handlers,
        force=True,
    )
    logging.getLogger("flwr").propagate = False  # Flower logs through its own handler already
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Flower HTTP request


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def compose_experiment(overrides: list[str]) -> tuple[ExperimentConfig, dict[str, Any]]:
    """The experiment train_fed.py would run with these command-line overrides (no Hydra run dir)."""
    from hydra import compose, initialize_config_dir

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return split_config(cfg)
