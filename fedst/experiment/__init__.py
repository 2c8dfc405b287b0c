"""Typed experiment configuration: the Hydra config enters here once and leaves as frozen objects.

A *method* (FedST, an ablation row, FedAvg, Local, a baseline) is a small set of choices over
shared pieces: its algorithm (``algorithm``: what sites and server compute, fedst/methods/), what
is personalized (``personalization``), which network components exist (``temporal``, ``prompt``,
``channel_selection``), how shared parameters are aggregated (``aggregation``), whether the server
runs SERQ (``serq``) and whether sites communicate at all (``communicate``).

The package: ``sections`` (method, train, pretraining, serq, fed, comm, privacy, selection and
indicator), ``config`` (:class:`ExperimentConfig`, which holds them with the data, network and clip
configs, and how a mapping or a saved config.json becomes one), ``roles`` (the role of every
field, fedst/schema/roles.py, as dotted keys), ``site_view`` (what a site receives of it and adds
from its own node: :class:`SiteNodeConfig`) and ``runtime`` (train_fed.py's :class:`Runtime`:
engine, resume, ``ray.*``, ``deploy.*``, the server's round policy).

Reading a config imports no torch, timm, torchvision, albumentations or flwr
(tests/test_config_floor.py): the network, clip and augment configs come from fedst/schema/,
fedst.data.sites imports the backends only to open a site, and :func:`run_device` imports
fedst.accel when called.

Layer: above fedst.model; imports fedst.data.sites, fedst.schema and the root modules.
"""

from fedst.experiment.config import (
    ExperimentConfig,
    experiment_from_dict,
    experiment_from_json,
    run_device,
    with_device,
)
from fedst.experiment.roles import field_roles, resume_safe_keys
from fedst.experiment.runtime import (
    ENGINES,
    EVAL_TIMEOUT_FACTOR,
    DeployConfig,
    RayConfig,
    RoundPolicy,
    Runtime,
    default_eval_timeout,
)
from fedst.experiment.sections import (
    AGGREGATION_WEIGHTS,
    AGGREGATIONS,
    DP_MODES,
    INDICATOR_KINDS,
    PRECISIONS,
    RETURNED_MODELS,
    SELECTION_RULES,
    SERQ_MODES,
    UNSEEN_INDICATOR_RULES,
    CommConfig,
    FedConfig,
    IndicatorConfig,
    MethodConfig,
    PretrainingConfig,
    PrivacyConfig,
    SelectionConfig,
    SerqConfig,
    TrainConfig,
    check_num_workers,
)
from fedst.experiment.site_view import (
    SITE_VIEW_UNSET,
    SiteNodeConfig,
    legacy_state_fingerprints,
    site_view,
    state_fingerprint,
)

__all__ = [
    "AGGREGATIONS",
    "AGGREGATION_WEIGHTS",
    "DP_MODES",
    "ENGINES",
    "EVAL_TIMEOUT_FACTOR",
    "INDICATOR_KINDS",
    "PRECISIONS",
    "RETURNED_MODELS",
    "SELECTION_RULES",
    "SERQ_MODES",
    "SITE_VIEW_UNSET",
    "UNSEEN_INDICATOR_RULES",
    "CommConfig",
    "DeployConfig",
    "ExperimentConfig",
    "FedConfig",
    "IndicatorConfig",
    "MethodConfig",
    "PretrainingConfig",
    "PrivacyConfig",
    "RayConfig",
    "RoundPolicy",
    "Runtime",
    "SelectionConfig",
    "SerqConfig",
    "SiteNodeConfig",
    "TrainConfig",
    "check_num_workers",
    "default_eval_timeout",
    "experiment_from_dict",
    "experiment_from_json",
    "field_roles",
    "legacy_state_fingerprints",
    "resume_safe_keys",
    "run_device",
    "site_view",
    "state_fingerprint",
    "with_device",
]
