"""Split a state_dict into personalized (rho) and shared (gamma) keys (Sec. III-B1, Eq. 5-6).

A :class:`PartitionRules` is a tuple of regular expressions matched (``re.search``) against
state_dict keys; matching float entries are personalized (never leave the site), all other float
entries are shared (averaged by the server). Non-float buffers are ``fixed``: never sent, never
averaged. :data:`PRESETS` holds one rule set per row of Tables V and VI; the channel-selection /
prompt modules have their own switch (``personalize_channel_selection``: FedST yes, FedAvg no).

The temporal module travels or stays as a whole: a rule set that personalizes part of
``temporal.*`` is rejected (the paper shares it; the Table IX reading ``rsc`` keeps all of it).

Partial aggregation by component (UltraFlwr): :data:`COMPONENTS` names the network's parts by
state-dict prefix; :func:`component_rules` makes every part that is not shared personal.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from fedst.schema.partition import (
    CHANNEL_SELECTION_PATTERN,
    COMPONENTS,
    PRESETS,
    TEMPORAL_PREFIX,
    PartitionRules,
)

__all__ = [
    "PRESETS",
    "Partition",
    "PartitionRules",
    "bytes_of",
    "count_parameters",
    "split_state",
]


def component_rules(model: nn.Module, shared: Iterable[str]) -> tuple[str, ...]:
    """Patterns that keep every component not in ``shared`` (and present in ``model``) private."""
    unknown = sorted(set(shared) - set(COMPONENTS))
    if unknown:
        raise ValueError(f"unknown component(s) {unknown}; choose from {sorted(COMPONENTS)}")
    keys = list(model.state_dict())
    return tuple(
        pattern
        for name, pattern in COMPONENTS.items()
        if name not in shared and any(re.search(pattern, k) for k in keys)
    )


@dataclass(frozen=True)
class Partition:
    """State_dict keys of a model, each in exactly one set."""

    personal: tuple[str, ...]
    shared: tuple[str, ...]
    fixed: tuple[str, ...]


def split_state(
    model: nn.Module, rules: PartitionRules, personalize_channel_selection: bool = True
) -> Partition:
    """Partition ``model.state_dict()`` keys into personal (rho), shared (gamma) and fixed."""
    state = model.state_dict()
    float_keys = [k for k, v in state.items() if v.is_floating_point()]
    fixed = tuple(k for k, v in state.items() if not v.is_floating_point())
    compiled = [re.compile(p) for p in rules.personal]
    unused = [p.pattern for p in compiled if not any(p.search(k) for k in float_keys)]
    if unused:
        raise ValueError(
            f"partition rule(s) {unused} match no float key of the model ({len(float_keys)} keys, "
            f"e.g. {float_keys[:3]}); fix the pattern or drop it"
        )
    selection = re.compile(CHANNEL_SELECTION_PATTERN)
    personal_set = {
        k
        for k in float_keys
        if any(p.search(k) for p in compiled)
        or (personalize_channel_selection and selection.search(k))
    }
    temporal = [k for k in float_keys if k.startswith(TEMPORAL_PREFIX)]
    personal_temporal = [k for k in temporal if k in personal_set]
    if personal_temporal and len(personal_temporal) != len(temporal):
        raise ValueError(
            f"partition rules {rules.personal} personalize temporal-module keys "
            f"{sorted(personal_temporal)[:3]} but not all of them; the temporal module is shared "
            f"or private as a whole (e.g. preset 'rsc')"
        )
    personal = tuple(k for k in float_keys if k in personal_set)
    shared = tuple(k for k in float_keys if k not in personal_set)
    return Partition(personal=personal, shared=shared, fixed=fixed)


def count_parameters(model: nn.Module, keys: Iterable[str]) -> int:
    """Number of scalars in the state_dict entries ``keys``."""
    state = model.state_dict()
    return sum(state[k].numel() for k in keys)


def bytes_of(model: nn.Module, keys: Iterable[str]) -> int:
    """Bytes of the state_dict entries ``keys`` in their stored dtypes (fp32: 4 per scalar)."""
    state = model.state_dict()
    return sum(state[k].numel() * state[k].element_size() for k in keys)
