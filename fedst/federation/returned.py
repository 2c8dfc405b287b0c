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

A site outside the federation meets that average through its indicator input
(``indicator.unseen``, resolved by ExperimentConfig.unseen_indicator_rule; docs/methods.md):

* ``own``: the average as above; the caller passes the site's own xi (its CLIP prompt);
* ``fold``: each site's frozen xi_k is folded into its own v_k's channel-selection bias
  (b'_k = b_k + W^xi_k xi_k, W^xi_k = 0; fedst.model.channel_selection.fold_indicator) before
  averaging, so the average reads no indicator: its gate parameters are the sample-weighted mean
  of the sites' effective ones, for any indicator kind;
* ``mean``: the average as above, run at xi_bar = sum_k n_k / n xi_k (folded into it the same way).

Under fold and mean the averaged model ignores the indicator its caller passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedst.errors import UserError
from fedst.experiment import ExperimentConfig
from fedst.methods import method_of
from fedst.model.channel_selection import fold_indicator
from fedst.model.network import FedSTNet
from fedst.model.state import load_subset

SiteState = Mapping[str, object]
"""{"personal": rho_k, "shared": gamma_k (optional), "num_examples": n_k, "site": name, ...};
the out-of-federation average under ``indicator.unseen`` fold or mean reads "site"."""


class ReturnedModelError(UserError, FileNotFoundError):
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
    """sum_k n_k / n v_k over the given site states (the out-of-federation model), with the
    unseen-site indicator rule applied (module docstring)."""
    rule = cfg.unseen_indicator_rule()
    if rule == "fold":
        return _folded_average(cfg, states, global_shared, device)
    if not method_of(cfg).returns_own_model:
        shared = returned_shared(cfg, states[0], global_shared)
    else:
        shared_states = [{**s, "shared": returned_shared(cfg, s, global_shared)} for s in states]
        shared = sample_weighted(shared_states, "shared")
    personal = sample_weighted(states, "personal")
    if rule == "mean":
        indicators = method_of(cfg).indicators()
        mean = sample_weighted([_with_indicator(s, indicators) for s in states], "indicator")
        shared = fold_indicator(shared, mean["xi"])
        personal = fold_indicator(personal, mean["xi"])
    return build_returned_model(cfg, shared, personal, device)


def _folded_average(
    cfg: ExperimentConfig,
    states: Sequence[SiteState],
    global_shared: Mapping[str, torch.Tensor],
    device: torch.device,
) -> FedSTNet:
    """sum_k n_k / n fold(v_k, xi_k): each site's indicator folded into its own model first."""
    indicators = method_of(cfg).indicators()
    folded = []
    for state in states:
        xi = _with_indicator(state, indicators)["indicator"]["xi"]
        shared = returned_shared(cfg, state, global_shared)
        folded.append(
            {
                "num_examples": state["num_examples"],
                "shared": fold_indicator(shared, xi),
                "personal": fold_indicator(state["personal"], xi),  # type: ignore[arg-type]
            }
        )
    shared = sample_weighted(folded, "shared") if folded[0]["shared"] else {}
    return build_returned_model(cfg, shared, sample_weighted(folded, "personal"), device)


def _with_indicator(state: SiteState, indicators: Mapping[str, torch.Tensor]) -> SiteState:
    """``state`` with its site's frozen indicator under ``state["indicator"]["xi"]``."""
    site = state.get("site")
    if site not in indicators:
        raise ReturnedModelError(
            f"a site state names site {site!r}, which has no indicator in this run's config "
            f"(indicators of {sorted(indicators)}): the unseen-site rule needs each site's xi_k"
        )
    return {**state, "indicator": {"xi": indicators[site]}}  # type: ignore[index]
