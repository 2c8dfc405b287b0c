"""Central differential privacy on the shared update, with Flower's own strategy wrappers and
client mods (``privacy.*``; /work/shared/reference/flower.md section 7).

* ``server_fixed`` / ``server_adaptive``: the server clips each site's update gamma_k - gamma_g^t
  to the L2 bound (fixed, or adapted each round towards ``target_clipped_quantile``), averages,
  and adds Gaussian noise of std noise_multiplier x bound / K (DifferentialPrivacyServerSide*).
* ``client_fixed`` / ``client_adaptive``: each site clips its own update before it leaves
  (Flower's ``fixedclipping_mod`` / ``adaptiveclipping_mod``, applied by the ClientApp to the
  shared part of what it received); the server adds the noise (DifferentialPrivacyClientSide*).

Only gamma is clipped and noised: personalized parameters never travel. Noise calibration
assumes a mean, so DP needs ``method.aggregation=fedavg``; the clipping arithmetic runs in NumPy on
the wire tensors, so client-side DP needs ``comm.precision=fp32`` (an fp16 sum of squares over
millions of values overflows). No privacy accountant is attached: the runs report the noise
multiplier and clipping bound they used, not an epsilon.

Adaptive clipping (Andrew et al. 2021): the bound moves geometrically towards the quantile of
update norms at which a fraction ``target_clipped_quantile`` of the updates is clipped. flwr 1.41's
wrappers move it the wrong way (``C *= exp(-lr * (clipped_fraction - target))`` raises the bound
when fewer updates than the target are clipped, so it runs away); the two adaptive wrappers below
override only that one step with the sign that converges (tests/test_communication.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from flwr.app import ArrayRecord
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from fedst.config import ConfigError
from fedst.experiment import ExperimentConfig, PrivacyConfig


class _ConvergingServerSideAdaptiveClipping(DifferentialPrivacyServerSideAdaptiveClipping):
    def _geometric_update(self, clipped_fraction: float) -> None:
        self.clipping_norm *= math.exp(
            self.clip_norm_lr * (clipped_fraction - self.target_clipped_quantile)
        )


class _ConvergingClientSideAdaptiveClipping(DifferentialPrivacyClientSideAdaptiveClipping):
    _geometric_update = _ConvergingServerSideAdaptiveClipping._geometric_update


CLIPPING_NORM_KEY = "clipping_norm"
"""ConfigRecord key of the clipping bound in a train instruction (Flower's KEY_CLIPPING_NORM)."""


def check_privacy(cfg: ExperimentConfig) -> None:
    """ConfigError when ``privacy.dp`` cannot mean what it says with this method's settings."""
    if cfg.privacy.dp == "none":
        return
    if cfg.method.aggregation != "fedavg":
        raise ConfigError(
            f"privacy.dp={cfg.privacy.dp} calibrates noise for a mean; method.aggregation="
            f"{cfg.method.aggregation} is not one. Use method.aggregation=fedavg"
        )
    if not cfg.method.communicate:
        raise ConfigError(f"privacy.dp={cfg.privacy.dp}: method {cfg.method.name} sends nothing")
    if cfg.privacy.dp.startswith("client") and cfg.comm.precision != "fp32":
        raise ConfigError(
            f"privacy.dp={cfg.privacy.dp} clips on the wire tensors and needs comm.precision=fp32 "
            f"(got {cfg.comm.precision}); use a server-side mode with {cfg.comm.precision}"
        )


def with_privacy(strategy: Strategy, privacy: PrivacyConfig, num_sites: int) -> Strategy:
    """``strategy`` wrapped in the Flower DP wrapper of ``privacy.dp`` (unchanged for "none")."""
    sigma, bound = privacy.noise_multiplier, privacy.clipping_norm
    adaptive: dict[str, Any] = {
        "initial_clipping_norm": bound,
        "target_clipped_quantile": privacy.target_clipped_quantile,
        "clip_norm_lr": privacy.clip_norm_lr,
    }
    if privacy.dp == "none":
        return strategy
    if privacy.dp == "server_fixed":
        return DifferentialPrivacyServerSideFixedClipping(strategy, sigma, bound, num_sites)
    if privacy.dp == "client_fixed":
        return DifferentialPrivacyClientSideFixedClipping(strategy, sigma, bound, num_sites)
    if privacy.dp == "server_adaptive":
        return _ConvergingServerSideAdaptiveClipping(strategy, sigma, num_sites, **adaptive)
    return _ConvergingClientSideAdaptiveClipping(strategy, sigma, num_sites, **adaptive)


def update_l2_norm(reply: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> float:
    """||gamma_k - gamma_g^t||_2 over the floating-point tensors of ``received`` (what the site was
    sent) that the reply carries: the norm the clipping modes bound. Logged per site and round
    (train.jsonl ``update_norm``) so that a fixed ``privacy.clipping_norm`` can be chosen from it."""
    squares = [
        (reply[key].double() - value.double()).square().sum()
        for key, value in received.items()
        if key in reply and value.is_floating_point()
    ]
    return math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0


def prepare_aggregation(strategy: Strategy, current: ArrayRecord) -> None:
    """Tell a server-side clipping wrapper what the sites received (the reference of an update);
    Flower's own loop does this in ``configure_train``, which our round loop does not call."""
    if isinstance(
        strategy,
        (DifferentialPrivacyServerSideFixedClipping, DifferentialPrivacyServerSideAdaptiveClipping),
    ):
        strategy.current_arrays = current


def instruction_config(strategy: Strategy) -> dict[str, float]:
    """What a train instruction carries for client-side clipping: the current bound."""
    if isinstance(
        strategy,
        (DifferentialPrivacyClientSideFixedClipping, DifferentialPrivacyClientSideAdaptiveClipping),
    ):
        return {CLIPPING_NORM_KEY: float(strategy.clipping_norm)}
    return {}


def client_mod(privacy: PrivacyConfig):
    """The Flower client mod of a client-side mode (None otherwise)."""
    return {"client_fixed": fixedclipping_mod, "client_adaptive": adaptiveclipping_mod}.get(
        privacy.dp
    )
