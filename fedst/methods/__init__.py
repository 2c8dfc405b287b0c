"""The federated methods by ``method.algorithm``; :func:`method_of` builds the one a run uses.

Adding a method: a module fedst/methods/<name>.py with a :class:`Method` subclass that overrides
only the steps it changes, one entry in :data:`METHODS`, and configs/method/<name>.yaml.

Layer: above fedst.experiment; imports the typed config, fedst.model, fedst.data and below
(aggregation rules and privacy are its modules; never fedst.runs, fedst.federation or the apps).
"""

from __future__ import annotations

from fedst.config import ConfigError
from fedst.experiment import ExperimentConfig
from fedst.methods.base import PERSONAL_KEY_SEPARATOR, FinalStage, LocalPhase, Method
from fedst.methods.fedas import FedAS
from fedst.methods.feddp import FedDP
from fedst.methods.fedld import FedLD
from fedst.methods.fedrep import FedRep
from fedst.methods.upperbound import UpperBound

METHODS: dict[str, type[Method]] = {
    "partial": Method,  # FedST, its ablations, FedAvg, Local (fedst/methods/base.py)
    "fedld": FedLD,  # FedLD (fedst/methods/fedld.py)
    "upperbound": UpperBound,  # pooled training, no federation (fedst/methods/upperbound.py)
    "fedrep": FedRep,  # Collins et al. 2021 (fedst/methods/fedrep.py)
    "fedas": FedAS,  # Yang, Huang, Ye 2024 (fedst/methods/fedas.py)
    "feddp": FedDP,  # Wang et al. 2023 (fedst/methods/feddp.py)
}


def method_of(cfg: ExperimentConfig) -> Method:
    """The :class:`Method` of ``cfg.method.algorithm`` with ``cfg``'s settings."""
    try:
        kind = METHODS[cfg.method.algorithm]
    except KeyError:
        raise ConfigError(
            f"method.algorithm={cfg.method.algorithm!r}; choose one of {sorted(METHODS)}"
        ) from None
    return kind(cfg)


__all__ = ["METHODS", "PERSONAL_KEY_SEPARATOR", "FinalStage", "LocalPhase", "Method", "method_of"]
