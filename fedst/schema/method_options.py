"""``method.options``: each algorithm's own settings as typed dataclasses, without torch, so a wrong
value (``method=fedrep method.options.head_iters=-1``) is refused when the config is read
(fedst.experiment.MethodConfig), before the methods' code loads. The methods (fedst/methods/)
read them as their ``Options``; :data:`OPTIONS` maps each ``method.algorithm`` to its class
(tests/test_config_floor.py ties it to fedst.methods.METHODS)."""

from __future__ import annotations

from dataclasses import dataclass

from fedst.config import ConfigError, require_at_least, require_positive


@dataclass(frozen=True)
class NoOptions:
    """A method without settings of its own."""


@dataclass(frozen=True)
class FedASOptions:
    prototype_batches: int = 10
    """Training batches over which the local model's class prototypes are averaged."""
    align_iters: int = 10
    """SGD steps aligning the received base to the prototypes (reference: 1 epoch); 0: no
    alignment (the reference's "w/o local" ablation)."""
    align_lr: float = 0.01
    """SGD learning rate of the alignment (reference: 0.01)."""
    fisher_batches: int = 10
    """Training batches on which the Fisher trace is measured (scaled to one epoch)."""

    def __post_init__(self) -> None:
        require_at_least("method.options.prototype_batches", self.prototype_batches, 1)
        require_at_least("method.options.align_iters", self.align_iters, 0)
        require_positive("method.options.align_lr", self.align_lr)
        require_at_least("method.options.fisher_batches", self.fisher_batches, 1)


@dataclass(frozen=True)
class FedDPOptions:
    """``method.options`` of FedDP (configs/method/feddp.yaml)."""

    tuning_rounds: float = 1.0
    """Length of stage 2 in local rounds' worth of iterations: round(tuning_rounds *
    train.local_iters) batches. The reference tunes 50 epochs (50 of its local rounds, one epoch
    each); 1 keeps the demo's stage 2 at the cost of one round (set 50 for the reference)."""
    tuning_lr: float = 1e-4
    """Adam learning rate of stage 2 (reference: 1e-4)."""
    lambda_uncertainty: float = 1.0
    """lambda of the uncertainty-weighted BCE. The public release reads it from a command-line
    argument whose default is not published; 1.0 weighs both terms equally (not tuned)."""
    channel_selection_stages: tuple[int, ...] = (3,)
    """Encoder stages (0-3) with FedDP's channel selection; reference: the last stage's features."""

    def __post_init__(self) -> None:
        if self.tuning_rounds < 0:
            raise ConfigError(f"method.options.tuning_rounds={self.tuning_rounds}: must be >= 0")
        if self.tuning_lr <= 0:
            raise ConfigError(f"method.options.tuning_lr={self.tuning_lr}: must be > 0")
        if self.lambda_uncertainty < 0:
            raise ConfigError(
                f"method.options.lambda_uncertainty={self.lambda_uncertainty}: must be >= 0"
            )


@dataclass(frozen=True)
class FedLDOptions:
    lambda_margin: float = 0.1
    """lambda of the margin-control term (paper: 0.1; the release's default flag is 0.03)."""
    principal_fraction: float = 0.8
    """k = floor(fraction * m) principal directions per tensor (paper and release: 0.8)."""

    def __post_init__(self) -> None:
        if self.lambda_margin < 0:
            raise ValueError(f"lambda_margin must be >= 0, got {self.lambda_margin}")
        if not 0 < self.principal_fraction <= 1:
            raise ValueError(f"principal_fraction must be in (0, 1], got {self.principal_fraction}")


@dataclass(frozen=True)
class FedRepOptions:
    head_iters: int | None = None
    """Head iterations (body frozen) before the round's ``train.local_iters`` body iterations
    (head frozen). None: as many as body iterations (see the module docstring)."""

    def __post_init__(self) -> None:
        require_at_least("method.options.head_iters", self.head_iters, 0)


OPTIONS: dict[str, type] = {
    "partial": NoOptions,  # FedST, its ablations, FedAvg, Local
    "fedld": FedLDOptions,
    "upperbound": NoOptions,
    "fedrep": FedRepOptions,
    "fedas": FedASOptions,
    "feddp": FedDPOptions,
}
"""``method.algorithm`` -> the dataclass its ``method.options`` are built into."""
