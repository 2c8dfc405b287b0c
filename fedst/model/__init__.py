"""FedST model parts: network, temporal module, channel selection, indicators, losses, partition.

Layer: above fedst.data; imports fedst.data, models and the root modules.
"""

from fedst.model.channel_selection import ChannelSelection, PromptBias
from fedst.model.indicators import IndicatorUnavailableError, site_indicators
from fedst.model.losses import SegmentationLoss
from fedst.model.network import FedSTNet, NetworkConfig, StreamingState, build_network
from fedst.model.partition import (
    PRESETS,
    Partition,
    PartitionRules,
    bytes_of,
    count_parameters,
    split_state,
)

__all__ = [
    "PRESETS",
    "ChannelSelection",
    "FedSTNet",
    "IndicatorUnavailableError",
    "NetworkConfig",
    "Partition",
    "PartitionRules",
    "PromptBias",
    "SegmentationLoss",
    "StreamingState",
    "build_network",
    "bytes_of",
    "count_parameters",
    "site_indicators",
    "split_state",
]
