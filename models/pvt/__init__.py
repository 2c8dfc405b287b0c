"""PVTv2 encoders (b0-b5, b2_li) with separately named q / k / v attention projections.

Build with :func:`create_pvt_v2` (or ``pvt_v2_b0`` ...); weights are located by
:func:`resolve_pretrained` and loaded by :func:`load_pretrained`.

Layer: below fedst; imports torch and timm only.
"""

from .pvt_v2 import (
    PVT_V2_VARIANTS,
    Attention,
    CheckpointMismatchError,
    LoadReport,
    PvtV2Encoder,
    checkpoint_filter_fn,
    create_pvt_v2,
    load_pretrained,
    pvt_v2_b0,
    pvt_v2_b1,
    pvt_v2_b2,
    pvt_v2_b2_li,
    pvt_v2_b3,
    pvt_v2_b4,
    pvt_v2_b5,
    split_fused_kv,
)
from .weights import WeightsNotFoundError, describe_weights, read_state_dict, resolve_pretrained

__all__ = [
    "PVT_V2_VARIANTS",
    "Attention",
    "CheckpointMismatchError",
    "LoadReport",
    "PvtV2Encoder",
    "WeightsNotFoundError",
    "checkpoint_filter_fn",
    "create_pvt_v2",
    "describe_weights",
    "load_pretrained",
    "pvt_v2_b0",
    "pvt_v2_b1",
    "pvt_v2_b2",
    "pvt_v2_b2_li",
    "pvt_v2_b3",
    "pvt_v2_b4",
    "pvt_v2_b5",
    "read_state_dict",
    "resolve_pretrained",
    "split_fused_kv",
]
