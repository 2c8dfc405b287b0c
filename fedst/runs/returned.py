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
(``indicator.unseen``, resolved by fedst.model.channel_selection.resolve_unseen_indicator_rule;
docs/methods.md):

* ``own``: the average as above; the caller passes the site's own xi (its CLIP prompt);
* ``fold``: each site's frozen xi_k is folded into its own v_k's channel-selection bias
  (b'_k = b_k + W^xi_k xi_k, W^xi_k = 0; fedst.model.channel_selection.fold_indicator) before
  averaging, so the average reads no indicator: its gate parameters are the sample-weighted mean
  of the sites' effective ones, for any indicator kind;
* ``mean``: the average as above, run at xi_bar = sum_k n_k / n xi_k (folded into it the same way).

Under fold and mean the averaged model ignores the indicator its caller passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from fedst.errors import UserError
from fedst.methods import Method
from fedst.model.channel_selection import fold_indicator
from fedst.model.network import FedSTNet
from fedst.model.state import load_subset
from fedst.runs.records import SiteState, TensorDict


class ReturnedModelError(UserError, FileNotFoundError):
    """A site state lacks the own gamma_k that method.returned_model=own needs."""


def sample_weighted(
    weights: Sequence[float], parts: Sequence[TensorDict]
) -> dict[str, torch.Tensor]:
    """sum_k w_k / sum(w) parts_k, tensor by tensor, accumulated in fp64, returned in fp32."""
    total = sum(weights)
    return {
        key: sum(
            w / total * part[key].double() for w, part in zip(weights, parts, strict=True)
        ).float()
        for key in parts[0]
    }


def weighted_by_samples(states: Sequence[SiteState], part: str) -> dict[str, torch.Tensor]:
    """sum_k n_k / n state_k.<part> (``personal`` or ``shared``) over site states."""
    parts = [getattr(state, part) for state in states]
    return sample_weighted([state.num_examples for state in states], parts)


def returned_shared(method: Method, state: SiteState, global_shared: TensorDict) -> TensorDict:
    """The shared part of the model a site returns: its own gamma_k (returned_model=own) or
    ``global_shared`` (gamma_g; empty when nothing travels)."""
    if not method.returns_own_model:
        return global_shared if method.communicates else {}
    if state.shared is None:
        raise ReturnedModelError(
            f"the state of site {state.site} (round {state.round if state.round is not None else '?'}) holds "
            f"no own shared parameters gamma_k, which method.returned_model=own scores (a run "
            f"from before they were kept, or a deployed site that missed the last round). Score "
            f"the run with method.returned_model=global (gamma_g U rho_k)"
        )
    return state.shared


def build_returned_model(
    method: Method, shared: TensorDict, personal: TensorDict, device: torch.device
) -> FedSTNet:
    """The method's network with ``shared`` and then ``personal`` loaded, on ``device``."""
    model = method.build_model()
    load_subset(model, dict(shared))
    load_subset(model, dict(personal))
    return model.to(device)


def site_model(
    method: Method, state: SiteState, global_shared: TensorDict, device: torch.device
) -> FedSTNet:
    """v_k of one site state (see the module docstring)."""
    shared = returned_shared(method, state, global_shared)
    return build_returned_model(method, shared, state.personal, device)


def averaged_site_model(
    method: Method, states: Sequence[SiteState], global_shared: TensorDict, device: torch.device
) -> FedSTNet:
    """sum_k n_k / n v_k over the given site states (the out-of-federation model), with the
    unseen-site indicator rule applied (module docstring)."""
    rule = method.cfg.unseen_indicator_rule()
    if rule == "fold":
        return _folded_average(method, states, global_shared, device)
    if not method.returns_own_model:
        shared = returned_shared(method, states[0], global_shared)
    else:
        returned = [
            dataclasses.replace(s, shared=returned_shared(method, s, global_shared)) for s in states
        ]
        shared = weighted_by_samples(returned, "shared")
    personal = weighted_by_samples(states, "personal")
    if rule == "mean":
        indicators = method.indicators()
        weights = [state.num_examples for state in states]
        xi_mean = sample_weighted(weights, [{"xi": site_indicator(s, indicators)} for s in states])
        shared = fold_indicator(shared, xi_mean["xi"])
        personal = fold_indicator(personal, xi_mean["xi"])
    return build_returned_model(method, shared, personal, device)


def _folded_average(
    method: Method, states: Sequence[SiteState], global_shared: TensorDict, device: torch.device
) -> FedSTNet:
    """sum_k n_k / n fold(v_k, xi_k): each site's indicator folded into its own model first."""
    indicators = method.indicators()
    folded = []
    for state in states:
        xi = site_indicator(state, indicators)
        shared = returned_shared(method, state, global_shared)
        folded.append(
            dataclasses.replace(
                state,
                shared=fold_indicator(shared, xi),
                personal=fold_indicator(state.personal, xi),
            )
        )
    shared = weighted_by_samples(folded, "shared") if folded[0].shared else {}
    return build_returned_model(method, shared, weighted_by_samples(folded, "personal"), device)


def site_indicator(state: SiteState, indicators: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The frozen indicator xi_k of the state's site."""
    if state.site not in indicators:
        raise ReturnedModelError(
            f"a site state names site {state.site!r}, which has no indicator in this run's config "
            f"(indicators of {sorted(indicators)}): the unseen-site rule needs each site's xi_k"
        )
    return indicators[state.site]
