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
* ``schema``: a field of the reply is missing, of another kind or out of its range (the schema
  the server owns, fedst/app/reply_schema.py);
* ``keys`` / ``shapes`` / ``dtype`` (training replies): its tensors are not exactly the server's
  shared parameters gamma_g, key for key, shape for shape and dtype for dtype;
* ``finite`` (training replies): a value is NaN or infinite;
* ``magnitude`` (training replies): a value exceeds :func:`magnitude_bound` of the wire precision;
* ``samples`` (training replies): its sample count n_k is not a whole number in [1, the data
  size the site reports], or that data size differs from the one of the site's previous accepted
  reply and the site does not say its data changed, or changed by more than
  ``fed.max_data_change`` x either way in one round (the server keeps the sizes in its
  checkpoint). The first reply is trusted: these checks catch faults, not a site that lies
  consistently;
* ``weight`` (training replies of a method that weighs by a scalar it declares, FedAS's Fisher
  trace): that scalar is beyond its declared factor of the round's median either way;
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
from dataclasses import dataclass, field

import torch

from fedst.methods.reply_fields import ReplyField
from fedst.methods.reply_keys import NUM_EXAMPLES

log = logging.getLogger(__name__)

CHECKS = (
    "schema",
    "round",
    "site",
    "wire",
    "keys",
    "shapes",
    "dtype",
    "finite",
    "magnitude",
    "samples",
    "weight",
    "norm",
)
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
    declared: Mapping[str, float] = field(default_factory=dict)
    """The method's own scalars of the reply (``Method.reply_scalars``), schema-checked."""


def magnitude_bound(precision: str) -> float:
    """The largest |value| the server accepts in a reply and in its own aggregate under wire
    precision ``precision``: min(sqrt(float32 max), the precision's largest finite value), i.e.
    1.84e19 for fp32 and bf16, 65504 for fp16.

    Why: the aggregate is a weighted mean (weights >= 0, summing to 1), so it is no larger than
    the largest reply and, below the wire's largest finite value, can be sent; and the server's
    fp32 work on it (SERQ's forward and backward, LayerNorm's variance, the norm rules) squares
    values, which stays finite in fp32 only below sqrt(3.4e38) = 1.84e19. A trained network is
    many orders of magnitude below both (docs/deployment.md, "Reply schema")."""
    largest = {
        "fp32": torch.finfo(torch.float32).max,
        "bf16": torch.finfo(torch.bfloat16).max,
        "fp16": torch.finfo(torch.float16).max,
    }[precision]
    return min(math.sqrt(torch.finfo(torch.float32).max), largest)


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
    state: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    bound: float = math.inf,
    reference_largest: Mapping[str, float] | None = None,
) -> tuple[tuple[str, str] | None, float | None]:
    """(problem, norm): (check, reason) when ``state`` is not ``reference``'s keys, shapes and
    dtypes with finite values of magnitude <= ``bound``, else None and the update norm
    ||state - reference||_2 over the floating-point tensors. One pass over the values: a NaN or
    inf makes its tensor's norm non-finite (``reference``, the server's gamma_g, is finite), and
    per tensor max|state| <= max|reference| + ||state - reference||_2, so only a tensor where
    that sum exceeds ``bound`` is read again for its exact largest value
    (``reference_largest``: :func:`largest_values` of ``reference``, computed once per round)."""
    missing = [k for k in reference if k not in state]
    extra = [k for k in state if k not in reference]
    if missing or extra:
        parts = [f"lacks {len(missing)} shared tensor(s), e.g. {missing[:3]}"] if missing else []
        parts += [f"has {len(extra)} the server does not share, e.g. {extra[:3]}"] if extra else []
        return ("keys", "; ".join(parts) + " (another network or method config?)"), None
    for check, differs, shown in (
        ("shapes", lambda a, b: a.shape != b.shape, lambda t: list(t.shape)),
        ("dtype", lambda a, b: a.dtype != b.dtype, lambda t: str(t.dtype).removeprefix("torch.")),
    ):
        wrong = [
            f"{k} {shown(state[k])} (server: {shown(v)})"
            for k, v in reference.items()
            if differs(state[k], v)
        ]
        if wrong:
            what = "shape" if check == "shapes" else "dtype"
            return (
                check,
                f"{len(wrong)} tensor(s) of another {what}, e.g. {', '.join(wrong[:3])}",
            ), None
    floats = [k for k, v in reference.items() if v.is_floating_point() and v.numel()]
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
    if math.isfinite(bound):
        largest = reference_largest or largest_values(reference)
        norms = squares.sqrt().tolist()
        near = [k for k, norm in zip(floats, norms, strict=True) if largest[k] + norm > bound]
        problem = magnitude_problem(state, bound, near) if near else None
        if problem is not None:
            return ("magnitude", problem), None
    return None, math.sqrt(float(squares.sum()))


def largest_values(state: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """max |value| of each non-empty floating-point tensor of ``state`` (NaN where it holds a
    NaN, inf where an inf): one pass, one host sync."""
    floats = [k for k, v in state.items() if v.is_floating_point() and v.numel()]
    if not floats:
        return {}
    largest = torch.stack(  # (tensors,)
        [torch.linalg.vector_norm(state[k], ord=math.inf).float() for k in floats]
    )
    return dict(zip(floats, largest.tolist(), strict=True))


def magnitude_problem(
    state: Mapping[str, torch.Tensor], bound: float, keys: Sequence[str] | None = None
) -> str | None:
    """Why the finite floating-point tensors ``keys`` of ``state`` (default: all) exceed
    ``bound`` in magnitude (:func:`magnitude_bound`), or None."""
    if math.isinf(bound):
        return None
    largest = largest_values(state if keys is None else {k: state[k] for k in keys})
    return _beyond(largest, bound)


def _beyond(largest: Mapping[str, float], bound: float) -> str | None:
    bad = [(k, m) for k, m in largest.items() if m > bound]
    if not bad:
        return None
    return (
        f"{len(bad)} tensor(s) hold values beyond the bound |x| <= {bound:.3g} of the wire "
        f"precision, e.g. {bad[0][0]} up to {bad[0][1]:.3g}"
    )


def aggregate_problem(state: Mapping[str, torch.Tensor], bound: float) -> str | None:
    """Why the server's own aggregate (or its model after the server step) may not be stored or
    sent: a NaN or inf value, or a value beyond ``bound``; None when it may. One pass."""
    largest = largest_values(state)
    bad = [k for k, m in largest.items() if not math.isfinite(m)]
    if bad:
        return f"{len(bad)} tensor(s) hold NaN or inf values, e.g. {bad[:3]}"
    return _beyond(largest, bound)


def tensor_problem(
    state: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]
) -> tuple[str, str] | None:
    """(check, reason) when ``state`` is not ``reference``'s keys and shapes with finite values."""
    return inspect_update(state, reference)[0]


def samples_problem(
    update: Update, previous_size: int | None, max_change: float = math.inf
) -> str | None:
    """Why ``update``'s sample count is implausible (``previous_size``: the data size of the
    site's previous accepted reply; None: this is its first; ``max_change``:
    ``fed.max_data_change``), or None."""
    if update.data_size is None:
        return "it reports no data size (run the same FedST version at every site)"
    n = update.num_examples
    if not (math.isfinite(n) and n == int(n) and 1 <= n <= update.data_size):
        return f"it claims n_k = {n:g} samples, outside [1, its data size {update.data_size}]"
    if previous_size is None or update.data_size == previous_size:
        return None
    if not update.data_changed:
        return (
            f"it reports a data size of {update.data_size}, {previous_size} in its previous "
            f"accepted reply, and does not say its data changed"
        )
    if not previous_size / max_change <= update.data_size <= previous_size * max_change:
        return (
            f"its data size changed from {previous_size} to {update.data_size}, beyond "
            f"fed.max_data_change={max_change:g} x either way in one round"
        )
    return None


def spread_problems(values: Mapping[str, float], scalar: ReplyField) -> dict[str, str]:
    """Site -> reason for every value of the declared ``scalar`` beyond its ``median_factor`` x
    the round's median either way."""
    factor = scalar.median_factor
    if factor is None or not values:
        return {}
    median = statistics.median(values.values())
    return {
        site: f"its {scalar.key!r} {value:.4g} is beyond {factor:g} x the round's median "
        f"{median:.4g} either way"
        for site, value in values.items()
        if not median / factor <= value <= median * factor
    }


def server_weights(updates: Mapping[str, Update], weight_by: str | None) -> dict[str, float]:
    """Each accepted update's aggregation weight, computed by the server and summing to 1:
    1/K (``weight_by`` None: uniform), n_k / sum n_j (:data:`NUM_EXAMPLES`: validated sample
    counts) or the share of a scalar the method declared (checked by then)."""
    raw = {
        site: 1.0
        if weight_by is None
        else update.num_examples
        if weight_by == NUM_EXAMPLES
        else update.declared[weight_by]
        for site, update in updates.items()
    }
    total = math.fsum(raw.values())
    return {site: value / total for site, value in raw.items()}


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
    """The checks of a round's training replies (``keys`` to ``norm``) and the weights the server
    computes for the accepted ones; keeps each site's data size from its latest accepted reply
    (:attr:`data_sizes`, saved with the server's checkpoint)."""

    def __init__(
        self,
        max_update_ratio: float | None = None,
        data_sizes: Mapping[str, int] | None = None,
        max_data_change: float = math.inf,
        bound: float = math.inf,
        weight_by: str | None = None,
        declared: Sequence[ReplyField] = (),
    ) -> None:
        """``bound``: :func:`magnitude_bound`; ``weight_by``: None (uniform), NUM_EXAMPLES (n_k)
        or the key of one of the method's ``declared`` scalars."""
        self.max_update_ratio = max_update_ratio
        self.data_sizes: dict[str, int] = dict(data_sizes or {})
        self.max_data_change = max_data_change
        self.bound = bound
        self.weight_by = weight_by
        self.declared = tuple(declared)

    def check(
        self, updates: Mapping[str, Update], reference: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, Refusal], dict[str, float]]:
        """The refusals among ``updates`` (by site) and the update norm of every reply whose
        tensors passed (against ``reference`` = gamma_g^t, what the sites were sent)."""
        refusals: dict[str, Refusal] = {}
        norms: dict[str, float] = {}
        largest = largest_values(reference) if math.isfinite(self.bound) else None
        for site, update in updates.items():
            problem, norm = inspect_update(update.state, reference, self.bound, largest)
            if problem is not None:
                refusals[site] = Refusal(site, *problem)
                continue
            norms[site] = norm
            previous = self.data_sizes.get(site)
            reason = samples_problem(update, previous, self.max_data_change)
            if reason is not None:
                refusals[site] = Refusal(site, "samples", reason)
        for scalar in self.declared:
            values = {
                s: u.declared[scalar.key]
                for s, u in updates.items()
                if s not in refusals and scalar.key in u.declared
            }
            for site, reason in spread_problems(values, scalar).items():
                refusals[site] = Refusal(site, "weight", reason)
        if self.max_update_ratio is not None:
            passed = {s: n for s, n in norms.items() if s not in refusals}
            for site, reason in norm_problems(passed, self.max_update_ratio).items():
                refusals[site] = Refusal(site, "norm", reason)
        for site, update in updates.items():
            if site in refusals or update.data_size is None:
                continue
            previous = self.data_sizes.setdefault(site, update.data_size)
            if previous != update.data_size:  # accepted: the site said its data changed
                log.warning(
                    "site %s: its data changed (%d -> %d training samples)",
                    site,
                    previous,
                    update.data_size,
                )
                self.data_sizes[site] = update.data_size
        return refusals, norms

    def weights(self, accepted: Mapping[str, Update]) -> dict[str, float]:
        """The server's aggregation weight of each accepted update (:func:`server_weights`)."""
        return server_weights(accepted, self.weight_by) if accepted else {}
