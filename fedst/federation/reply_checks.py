"""What the server checks in a site's reply before it is averaged (docs/deployment.md, "What the
server checks"): plain functions over state dicts, so every engine (in-process, Ray, deployment)
applies the same rules through fedst.app.messaging.SiteGrid.ask, and tests need no Flower.

A refused reply is a dropped site for its round (the round goes on when ``deploy.min_sites``
allows, else the run stops with the refusal's line), logged in train.jsonl (``refused``: the
check, ``reason``) and wire.jsonl, and counted in final.json (``refused_replies``). The checks:

* ``round``: the reply names another round than its instruction, answers no message of the
  step, or answers one a second time;
* ``site``: its site is not in the federation, or its node answered as another site before;
* ``wire``: its parameters cannot be unpacked (fedst/federation/transport.py);
* ``keys`` / ``shapes`` (training replies): its tensors are not exactly the server's shared
  parameters gamma_g, key for key and shape for shape;
* ``finite`` (training replies): a value is NaN or infinite;
* ``samples`` (training replies): its sample count n_k is not a whole number in [1, the data
  size the site reports], or that data size differs from the one of the site's first accepted
  reply and the site does not say its data changed (the server keeps the sizes in its
  checkpoint). The first reply is trusted: these checks catch faults, not a site that lies
  consistently;
* ``norm`` (training replies; ``fed.max_update_ratio`` = R, off by default): the update norm
  ||gamma_k - gamma_g^t||_2 exceeds R x the median of the round's update norms (those of the
  replies that passed the checks above). With two sites the median is the mean of both norms,
  so no update exceeds 2 x the median: the rule needs three sites or more to refuse anything.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CHECKS = ("round", "site", "wire", "keys", "shapes", "finite", "samples", "norm")
"""Every check's name, as train.jsonl ``refused`` and final.json ``refused_replies`` write it."""


@dataclass(frozen=True)
class Refusal:
    """One refused reply: the site it came from (or its node), the check and the reason."""

    site: str
    check: str
    reason: str

    def line(self) -> str:
        return f"refused the reply of site {self.site} ({self.check} check): {self.reason}"

    def row(self, server_round: int, step: str) -> dict[str, object]:
        """Its train.jsonl row."""
        return {
            "round": server_round,
            "site": self.site,
            "step": step,
            "refused": self.check,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Update:
    """What the checks read of a training reply."""

    state: Mapping[str, torch.Tensor]
    """gamma_k as received, floats in fp32."""
    num_examples: float
    """n_k as reported (the weight of ``method.aggregation_weights=samples``)."""
    data_size: int | None
    """The size of the site's validated training data, as it reports it (None: not reported)."""
    data_changed: bool = False
    """The site says its data changed since its previous round."""


def identity_problem(
    site: str,
    declared_round: int | None,
    expected_round: int,
    federation: Sequence[str],
    known_site: str | None,
) -> tuple[str, str] | None:
    """(check, reason) when a reply from a node known as ``known_site`` (None: not yet) that
    says it is ``site`` answering ``declared_round`` is not the answer to ``expected_round``."""
    if site not in federation:
        return (
            "site",
            f"it says it is site {site!r}, which is not in the federation {list(federation)}",
        )
    if known_site is not None and site != known_site:
        return "site", f"it says it is site {site}, its node answered as site {known_site} before"
    if declared_round is None:
        return "round", "it names no round (run the same FedST version at every site)"
    if declared_round != expected_round:
        return "round", f"it answers round {declared_round}, the step asked round {expected_round}"
    return None


def inspect_update(
    state: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]
) -> tuple[tuple[str, str] | None, float | None]:
    """(problem, norm): (check, reason) when ``state`` is not ``reference``'s keys and shapes
    with finite values, else None and the update norm ||state - reference||_2 over the
    floating-point tensors. One pass over the values: a NaN or inf makes its tensor's norm
    non-finite (``reference``, the server's gamma_g, is finite)."""
    missing = [k for k in reference if k not in state]
    extra = [k for k in state if k not in reference]
    if missing or extra:
        parts = [f"lacks {len(missing)} shared tensor(s), e.g. {missing[:3]}"] if missing else []
        parts += [f"has {len(extra)} the server does not share, e.g. {extra[:3]}"] if extra else []
        return ("keys", "; ".join(parts) + " (another network or method config?)"), None
    wrong = [
        f"{k} {list(state[k].shape)} (server: {list(v.shape)})"
        for k, v in reference.items()
        if state[k].shape != v.shape
    ]
    if wrong:
        return (
            "shapes",
            f"{len(wrong)} tensor(s) of another shape, e.g. {', '.join(wrong[:3])}",
        ), None
    floats = [k for k, v in reference.items() if v.is_floating_point()]
    if not floats:
        return None, 0.0
    squares = torch.stack(  # (tensors,): ||gamma_k - gamma_g^t||^2 per tensor
        [
            torch.linalg.vector_norm(state[k].float() - reference[k], dtype=torch.float64).square()
            for k in floats
        ]
    )
    finite = squares.isfinite()
    if not bool(finite.all()):
        bad = [k for k, ok in zip(floats, finite.tolist(), strict=True) if not ok]
        return ("finite", f"{len(bad)} tensor(s) hold NaN or inf values, e.g. {bad[:3]}"), None
    return None, math.sqrt(float(squares.sum()))


def tensor_problem(
    state: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]
) -> tuple[str, str] | None:
    """(check, reason) when ``state`` is not ``reference``'s keys and shapes with finite values."""
    return inspect_update(state, reference)[0]


def samples_problem(update: Update, first_size: int | None) -> str | None:
    """Why ``update``'s sample count is implausible (``first_size``: the data size of the site's
    first accepted reply; None: this is its first), or None."""
    if update.data_size is None:
        return "it reports no data size (run the same FedST version at every site)"
    n = update.num_examples
    if not (math.isfinite(n) and n == int(n) and 1 <= n <= update.data_size):
        return f"it claims n_k = {n:g} samples, outside [1, its data size {update.data_size}]"
    if first_size is not None and update.data_size != first_size and not update.data_changed:
        return (
            f"it reports a data size of {update.data_size}, {first_size} in its first reply, "
            f"and does not say its data changed"
        )
    return None


def norm_problems(norms: Mapping[str, float], ratio: float) -> dict[str, str]:
    """Site -> reason for every norm above ``ratio`` x the median of ``norms`` (none when the
    median is 0: nothing moved to compare with)."""
    if not norms:
        return {}
    median = statistics.median(norms.values())
    if median <= 0:
        return {}
    return {
        site: f"its update norm {norm:.4g} exceeds fed.max_update_ratio={ratio:g} x the "
        f"round's median {median:.4g}"
        for site, norm in norms.items()
        if norm > ratio * median
    }


class ReplyChecker:
    """The checks of a round's training replies (``keys`` to ``norm``); keeps each site's data
    size from its first accepted reply (:attr:`data_sizes`, saved with the server's checkpoint)."""

    def __init__(
        self, max_update_ratio: float | None = None, data_sizes: Mapping[str, int] | None = None
    ) -> None:
        self.max_update_ratio = max_update_ratio
        self.data_sizes: dict[str, int] = dict(data_sizes or {})

    def check(
        self, updates: Mapping[str, Update], reference: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, Refusal], dict[str, float]]:
        """The refusals among ``updates`` (by site) and the update norm of every reply whose
        tensors passed (against ``reference`` = gamma_g^t, what the sites were sent)."""
        refusals: dict[str, Refusal] = {}
        norms: dict[str, float] = {}
        for site, update in updates.items():
            problem, norm = inspect_update(update.state, reference)
            if problem is not None:
                refusals[site] = Refusal(site, *problem)
                continue
            norms[site] = norm
            reason = samples_problem(update, self.data_sizes.get(site))
            if reason is not None:
                refusals[site] = Refusal(site, "samples", reason)
        if self.max_update_ratio is not None:
            passed = {s: n for s, n in norms.items() if s not in refusals}
            for site, reason in norm_problems(passed, self.max_update_ratio).items():
                refusals[site] = Refusal(site, "norm", reason)
        for site, update in updates.items():
            if site in refusals or update.data_size is None:
                continue
            first = self.data_sizes.setdefault(site, update.data_size)
            if first != update.data_size:  # accepted: the site said its data changed
                log.warning(
                    "site %s: its data changed (%d -> %d training samples)",
                    site,
                    first,
                    update.data_size,
                )
                self.data_sizes[site] = update.data_size
        return refusals, norms
