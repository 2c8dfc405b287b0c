"""FedRep (Collins et al., ICML 2021): a shared body, a private head, trained in alternation.

Each round a site first trains its private head with the body frozen, then the body with the head
frozen (Collins et al., Algorithm 1: tau_h head updates, then tau body updates), and sends only
the body; the server averages the bodies. Here the head is the final 1x1 classifier
(fedst/methods/head.py), the body everything else, and both phases share the round's
``train.local_iters`` E: ``head_iters`` for the head, the rest for the body. FedRep's
experiments train the head for 10 local epochs and then the body for 1 (their code: ``local_ep``
11, ``local_rep_ep`` 1), so the default is round(10/11 E) head iterations, leaving the body at
least one. (FedDP's public release implements only the FedPer-like split without the
alternation; this is the alternation.)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fedst.config import ConfigError, require_at_least
from fedst.experiment import ExperimentConfig
from fedst.methods.base import LocalPhase, Method
from fedst.methods.head import is_head, with_private_head
from fedst.model.partition import Partition

HEAD_SHARE = 10 / 11
"""FedRep's head share of the local epochs: 10 head epochs, then 1 body epoch."""


def _body(key: str) -> bool:
    return not is_head(key)


@dataclass(frozen=True)
class FedRepOptions:
    head_iters: int | None = None
    """Local iterations per round that train the head (body frozen); the body trains the other
    ``train.local_iters - head_iters`` (head frozen). None: FedRep's 10:1 epoch ratio,
    round(10/11 local_iters), at most local_iters - 1."""

    def __post_init__(self) -> None:
        require_at_least("method.options.head_iters", self.head_iters, 0)


class FedRep(Method):
    """Head private; per round: head phase (body frozen), then body phase (head frozen)."""

    Options = FedRepOptions

    def __init__(self, cfg: ExperimentConfig) -> None:
        super().__init__(cfg)
        head, local_iters = self.options.head_iters, cfg.train.local_iters
        if head is not None and local_iters > 0 and head >= local_iters:
            raise ConfigError(
                f"method.options.head_iters={head} leaves no body iteration of "
                f"train.local_iters={local_iters}; set head_iters below local_iters (or null: "
                f"FedRep's 10:1 split)"
            )

    def partition(self, model: nn.Module) -> Partition:
        """The method's partition with the head always private."""
        return with_private_head(super().partition(model), model)

    def head_iterations(self, local_iters: int) -> int:
        """Head iterations of a round of ``local_iters`` (see :class:`FedRepOptions`)."""
        if self.options.head_iters is None:
            return max(0, min(local_iters - 1, round(HEAD_SHARE * local_iters)))
        if local_iters > 0 and self.options.head_iters >= local_iters:
            raise ValueError(
                f"method.options.head_iters={self.options.head_iters} leaves no body iteration "
                f"of train.local_iters={local_iters}; set head_iters below local_iters"
            )
        return min(self.options.head_iters, local_iters)

    def local_phases(self, local_iters: int) -> list[LocalPhase]:
        head = self.head_iterations(local_iters)
        return [
            LocalPhase(head, trainable=is_head, name="head"),
            LocalPhase(local_iters - head, trainable=_body, name="body"),
        ]

    def describe(self) -> dict:
        return {**super().describe(), "head_iters": self.options.head_iters}
