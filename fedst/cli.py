"""Shared plumbing of the Hydra entry points (train_fed.py, eval_outfed.py)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedst.config import ConfigError, to_dict
from fedst.data.sites import DataConfig
from fedst.experiment import DeployConfig, ExperimentConfig, RayConfig, experiment_from_dict
from fedst.methods import method_of

RUNTIME_KEYS = ("engine", "resume", "progress", "regenerate", "site", "deploy", "ray")
"""Top-level keys that steer the entry point, not the experiment."""

log = logging.getLogger(__name__)


DEFAULTS_NODE = "fedst_defaults"


def register_resolvers() -> None:
    """Prepare Hydra for our configs (idempotent).

    * ``${fedst.div:a,b}`` = a // b (rounds = total_iters // local_iters in experiment configs).
    * ``${fedst.curve_every:rounds,points}`` = max(1, rounds // points): the evaluation interval
      that gives a learning curve about ``points`` points (the Fig. 5 ablations' train.eval_every).
    * ``fedst_defaults``: every field of the typed configs (fedst/experiment/ and the dataclasses
      it holds) with its dataclass default, stored in Hydra's ConfigStore and listed first in
      configs/config.yaml. Defaults are thus defined once, in code, and every key can be
      overridden from the command line (``method.serq=false``) while a typo is still an error.
    """
    if not OmegaConf.has_resolver("fedst.div"):
        OmegaConf.register_new_resolver("fedst.div", _integer_division)
    if not OmegaConf.has_resolver("fedst.curve_every"):
        OmegaConf.register_new_resolver("fedst.curve_every", _curve_every)
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=DEFAULTS_NODE, node=_experiment_defaults())


def _integer_division(a: Any, b: Any) -> int:
    """``${fedst.div:a,b}``: rounds = train.total_iters // train.local_iters."""
    if not (_is_int(a) and _is_int(b) and int(b) >= 1):
        raise ConfigError(
            f"train.total_iters={a!r}, train.local_iters={b!r} (rounds = total_iters // "
            "local_iters): both must be integers and train.local_iters >= 1"
        )
    return int(a) // int(b)


def _curve_every(rounds: Any, points: Any) -> int:
    """``${fedst.curve_every:rounds,points}``: evaluate every max(1, rounds // points) rounds."""
    if not (_is_int(rounds) and _is_int(points) and int(points) >= 1):
        raise ConfigError(
            f"fedst.curve_every: rounds={rounds!r}, points={points!r}: both must be integers "
            "and points >= 1"
        )
    return max(1, int(rounds) // int(points))


def _is_int(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and value.strip().lstrip("-").isdigit()
    )


def _experiment_defaults() -> dict[str, Any]:
    """Defaults of every ExperimentConfig field; of ``data`` (no default: its sites are the data
    config's), the defaults of its other fields (e.g. ``data.mix_synthetic``)."""
    values: dict[str, Any] = {
        item.name: to_dict(_default(item))
        for item in dataclasses.fields(ExperimentConfig)
        if item.name != "data"
    }
    values["data"] = {
        item.name: to_dict(_default(item))
        for item in dataclasses.fields(DataConfig)
        if item.default is not dataclasses.MISSING
        or item.default_factory is not dataclasses.MISSING
    }
    values["deploy"] = to_dict(DeployConfig())  # train_fed.py site=...: fedst/deploy/
    values["ray"] = to_dict(RayConfig())  # engine=ray: fedst.training.ray_client_resources
    return values


def _default(item: dataclasses.Field) -> Any:
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.default


def split_config(cfg: DictConfig) -> tuple[ExperimentConfig, dict[str, Any]]:
    """Resolve the Hydra config into (typed experiment, runtime options)."""
    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        cause = err.__cause__ if isinstance(err.__cause__, ConfigError) else err
        raise ConfigError(f"config: {cause}") from err
    assert isinstance(values, dict)
    values.pop("hydra", None)
    runtime = {k: values.pop(k) for k in RUNTIME_KEYS if k in values}
    experiment = experiment_from_dict(values)
    method_of(experiment)  # the method's own options and combinations, checked here once
    return experiment, runtime


RESUME_SAFE_KEYS = (
    "train.eval_every",
    "train.val_every",
    "train.device",
    "train.num_workers",
    "train.eval_batch_size",
    "train.distance_metrics_every",
    "train.checkpoint_every",
    "serq.bank_storage",
    "network.encoder_grad_checkpointing",
    "train.compile",
    "train.channels_last",
    "train.deterministic",
    "train.require_gpu",
)
"""Experiment keys a resumed run accepts from the command line: they change when and where it
computes (evaluation cadence, device, loader workers, checkpoint cadence, where SERQ's working
bank lives, activation recomputation, compile mode, memory layout, deterministic kernels), not
what it learns. The runtime keys
(progress, engine, regenerate) are always accepted; anything else is refused on resume."""


def resume_experiment(
    saved: ExperimentConfig, composed: ExperimentConfig, overrides: list[str]
) -> ExperimentConfig:
    """The run's own ``saved`` config, changed only by the safe command-line ``overrides``.

    ``composed`` is the experiment Hydra built from today's configs and the same overrides; the
    values of the safe keys are taken from it (each change logged). An override of any other key
    that would change the saved value is a ConfigError naming it.
    """
    saved_values, composed_values = _flatten(to_dict(saved)), _flatten(to_dict(composed))
    refused, accepted = [], []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.split(".")[0] in (*RUNTIME_KEYS, "hydra"):  # e.g. deploy.port, hydra.run.dir
            continue
        if key in RESUME_SAFE_KEYS:
            accepted.append(key)
        elif key not in saved_values or saved_values[key] != composed_values.get(key):
            refused.append(override)
    if refused:
        raise ConfigError(
            f"resume: the run's own config is kept, so {refused} cannot be applied (it would "
            f"change what the run learns). Accepted on resume: {list(RESUME_SAFE_KEYS)} and "
            f"{list(RUNTIME_KEYS)}; start a new run to change anything else"
        )
    for key in dict.fromkeys(accepted):
        section, name = key.split(".")
        old, new = getattr(getattr(saved, section), name), getattr(getattr(composed, section), name)
        if old != new:
            log.info("resume: %s changed from %r to %r (command line)", key, old, new)
            part = dataclasses.replace(getattr(saved, section), **{name: new})
            saved = dataclasses.replace(saved, **{section: part})
    return saved


def learning_differences(a: ExperimentConfig, b: ExperimentConfig) -> list[str]:
    """Keys (``"train.lr"``) whose values differ between ``a`` and ``b``, ignoring the keys a
    resumed run accepts (:data:`RESUME_SAFE_KEYS`: they change when and where a run computes, not
    what it learns). Empty: a run of ``a`` is a run of ``b``."""
    flat_a, flat_b = _flatten(to_dict(a)), _flatten(to_dict(b))
    keys = sorted(set(flat_a) | set(flat_b))
    return [k for k in keys if k not in RESUME_SAFE_KEYS and flat_a.get(k) != flat_b.get(k)]


def _flatten(values: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{"a.b.c": value}``."""
    if not isinstance(values, dict):
        return {prefix: values}
    flat: dict[str, Any] = {}
    for key, value in values.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


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
