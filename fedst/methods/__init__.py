"""The federated methods by ``method.algorithm``; :func:`method_of` builds the one a run uses.

Adding a method: a module fedst/methods/<name>.py with a :class:`Method` subclass that overrides
only the steps it changes, one entry in :data:`METHODS`, and configs/method/<name>.yaml.
"""

from __future__ import annotations

from fedst.config import ConfigError
from fedst.experiment import ExperimentConfig
from fedst.methods.base import LocalPhase, Method
from fedst.methods.fedld import FedLD
from fedst.methods.upperbound import UpperBound

METHODS: dict[str, type[Method]] = {
    "partial": Method,  # FedST, its ablations, FedAvg, Local (fedst/methods/base.py)
    "fedld": FedLD,  # FedLD (fedst/methods/fedld.py)
    "upperbound": UpperBound,  # pooled training, no federation (fedst/methods/upperbound.py)
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


__all__ = ["METHODS", "LocalPhase", "Method", "method_of"]
