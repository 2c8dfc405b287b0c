"""The models a run returns: each site's v_k (Algorithm 1, lines 14-17) and their average.

A site's model after round N is rebuilt from what the run keeps of it, a *site state*
``{"personal": rho_k, "shared": gamma_k (optional), "num_examples": n_k}`` (the site's
``state_rNNNN.pt`` or its selection snapshot), and the server's gamma_g of that round:

* ``method.returned_model=own`` (FedST, Local, the upper bound): v_k = gamma_k U rho_k, the
  site's own shared parameters after its last local round;
* ``global`` (FedAvg, FedLD, FedRep, FedAS, FedDP before its stage 2): v_k = gamma_g U rho_k.
  (FedAS's site scores gamma_g after its alignment; rebuilt away from the site's data, the
  alignment cannot be repeated, so these models use gamma_g as received.)

The out-of-federation model (paper Sec. IV-B2: "we aggregate the parameters of personalized
models on the server via weighted averaging") is sum_k n_k / n v_k over the sites' returned
models, personalized parts included: gamma_g U avg(rho_k) under ``global``, avg(gamma_k) U
avg(rho_k) under ``own``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedst.experiment import ExperimentConfig
from fedst.methods import method_of
from fedst.model.network import FedSTNet
from fedst.model.state import load_subset

SiteState = Mapping[str, object]
"""{"personal": rho_k, "shared": gamma_k (optional), "num_examples": n_k, ...}."""


class ReturnedModelError(FileNotFoundError):
    """A site state lacks the own gamma_k that method.returned_model=own needs."""


def sample_weighted(states: Sequence[SiteState], part: str) -> dict[str, torch.Tensor]:
    """sum_k n_k / n state_k[part] over site states, accumulated in fp64, returned in fp32."""
    weights = [float(state["num_examples"]) for state in states]
    total = sum(weights)
    first: Mapping[str, torch.Tensor] = states[0][part]  # type: ignore[assignment]
    return {
        key: sum(
            w / total * s[part][key].double()  # type: ignore[index]
            for w, s in zip(weights, states, strict=True)
        ).float()
        for key in first
    }


def returned_shared(
    cfg: ExperimentConfig, state: SiteState, global_shared: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """The shared part of the model a site returns: its own gamma_k (returned_model=own) or
    ``global_shared`` (gamma_g; empty when nothing travels)."""
    method = method_of(cfg)
    if not method.returns_own_model:
        return global_shared if method.communicates else {}
    if "shared" not in state:
        raise ReturnedModelError(
            f"the state of site {state.get('site', '?')} (round {state.get('round', '?')}) holds "
            f"no own shared parameters gamma_k, which method.returned_model=own scores (a run "
            f"from before they were kept, or a deployed site that missed the last round). Score "
            f"the run with method.returned_model=global (gamma_g U rho_k)"
        )
    return state["shared"]  # type: ignore[return-value]


def build_returned_model(
    cfg: ExperimentConfig,
    shared: Mapping[str, torch.Tensor],
    personal: Mapping[str, torch.Tensor],
    device: torch.device,
) -> FedSTNet:
    """The method's network with ``shared`` and then ``personal`` loaded, on ``device``."""
    model = method_of(cfg).build_model()
    load_subset(model, dict(shared))
    load_subset(model, dict(personal))
    return model.to(device)


def site_model(
    cfg: ExperimentConfig,
    state: SiteState,
    global_shared: Mapping[str, torch.Tensor],
    device: torch.device,
) -> FedSTNet:
    """v_k of one site state (see the module docstring)."""
    shared = returned_shared(cfg, state, global_shared)
    return build_returned_model(cfg, shared, state["personal"], device)  # type: ignore[arg-type]


def averaged_site_model(
    cfg: ExperimentConfig,
    states: Sequence[SiteState],
    global_shared: Mapping[str, torch.Tensor],
    device: torch.device,
) -> FedSTNet:
    """sum_k n_k / n v_k over the given site states (the out-of-federation model)."""
    if not method_of(cfg).returns_own_model:
        shared = returned_shared(cfg, states[0], global_shared)
    else:
        shared_states = [{**s, "shared": returned_shared(cfg, s, global_shared)} for s in states]
        shared = sample_weighted(shared_states, "shared")
    return build_returned_model(cfg, shared, sample_weighted(states, "personal"), device)
