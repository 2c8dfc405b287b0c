"""Which state-dict keys stay at a site, as the config names them, without torch:
:class:`PartitionRules` (regexes of personalized keys), :data:`PRESETS` (``method.personalization``:
one per row of Tables V and VI) and :data:`COMPONENTS` (``method.shared_components``);
fedst/model/partition.py applies them to a network."""

from __future__ import annotations

import re
from dataclasses import dataclass

CHANNEL_SELECTION_PATTERN = r"^(channel_selection|prompt)\."
TEMPORAL_PREFIX = "temporal."

_ENC_Q = r"^encoder\..*\.attn\.q\.(weight|bias)$"
_ENC_K = r"^encoder\..*\.attn\.k\.(weight|bias)$"
_ENC_V = r"^encoder\..*\.attn\.v\.(weight|bias)$"
_DEC_Q = r"^decoder\..*\.attn\.q\.(weight|bias)$"


@dataclass(frozen=True)
class PartitionRules:
    """Regexes (``re.search`` on state_dict keys) selecting the personalized entries."""

    # Patterns of personalized keys; each must match at least one key of the model.
    personal: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for pattern in self.personal:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"PartitionRules: invalid regex {pattern!r}: {err}") from err


PRESETS: dict[str, PartitionRules] = {
    # Table V row 1: everything shared (FedAvg-style).
    "none": PartitionRules(()),
    # Table V row 2: everything personalized (local training).
    "all": PartitionRules((r".*",)),
    # Table V row 5 / Table VI "Query" (FedST, FedDP): every encoder attention query.
    "encoder_query": PartitionRules((_ENC_Q,)),
    # Table VI "Key".
    "encoder_key": PartitionRules((_ENC_K,)),
    # Table VI "Value".
    "encoder_value": PartitionRules((_ENC_V,)),
    # Table VI "Key&Value".
    "encoder_key_value": PartitionRules((_ENC_K, _ENC_V)),
    # Table VI "Norm": every encoder LayerNorm (block norm1/norm2, attention sr-norm, stage norms,
    # patch-embedding norms).
    "encoder_norm": PartitionRules((r"^encoder\.(.*\.)?norm\d*\.(weight|bias)$",)),
    # Table V row 3: decoder attention queries.
    "decoder_query": PartitionRules((_DEC_Q,)),
    # Table V row 4: encoder and decoder attention queries.
    "encoder_decoder_query": PartitionRules((_ENC_Q, _DEC_Q)),
    # Table IX reading: the whole RSC module stays at the site (encoder queries and the temporal
    # module here; channel selection by its own switch), the only reading in which the upload
    # shrinks by more than the queries (docs/methods.md, "Where we differ from the paper").
    "rsc": PartitionRules((_ENC_Q, r"^temporal\.")),
}

COMPONENTS: dict[str, str] = {
    "encoder": r"^encoder\.",
    "temporal": r"^temporal\.",
    "decoder": r"^decoder\.(?!head\.)",
    "head": r"^decoder\.head\.",
    "channel_selection": CHANNEL_SELECTION_PATTERN,
}
"""The network's components by state-dict key pattern (``method.shared_components``)."""
