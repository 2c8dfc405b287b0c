"""Specification of the personalized / shared parameter split (Sec. III-B1; Tables V, VI)."""

import re

import pytest
import torch
from torch import nn

from fedst.model.network import FedSTNet, NetworkConfig, build_network
from fedst.model.partition import (
    PRESETS,
    PartitionRules,
    bytes_of,
    count_parameters,
    split_state,
)

B0_DIMS = (32, 64, 160, 256)
B0_DEPTHS = (2, 2, 2, 2)
B0_SR_RATIOS = (8, 4, 2, 1)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """One intra-op thread: on a shared, loaded CPU spinning OpenMP threads make tiny ops slow."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


# Independent counts from the PVTv2-b0 / FedST module shapes.
ENCODER_QUERY = sum(d * linear(c, c) for c, d in zip(B0_DIMS, B0_DEPTHS, strict=True))
ENCODER_NORM = sum(
    2
    * c
    * (2 + d * (2 + (sr > 1)))  # patch-embed norm, stage norm; per block norm1, norm2, sr norm
    for c, d, sr in zip(B0_DIMS, B0_DEPTHS, B0_SR_RATIOS, strict=True)
)
DECODER_QUERY = linear(128, 128)
CHANNEL_SELECTION = linear(64 + 512, 64)  # default CS stage 1: FC([GAP(F*) (64), xi (512)]) -> 64
TEMPORAL = (
    sum(linear(64 * p * p, 64) for p in (7, 4, 2))  # Eq. 3 pooling FCs
    + 4 * linear(64, 64)  # q, k, v, proj
    + 2 * 49 * (49 + 25 + 9 + 49)  # relative position bias [heads, s*s, context tokens]
)

# Pinned integers (checked against the independent counts above in the first test).
TOTAL = 5_073_388
PINNED_PERSONAL = {  # preset -> (personal params without CS, with CS personalized)
    "none": (0, 36_928),
    "all": (TOTAL, TOTAL),
    "encoder_query": (193_536, 230_464),
    "encoder_key": (193_536, 230_464),
    "encoder_value": (193_536, 230_464),
    "encoder_key_value": (387_072, 424_000),
    "encoder_norm": (7_168, 44_096),
    "decoder_query": (16_512, 53_440),
    "encoder_decoder_query": (210_048, 246_976),
}


@pytest.fixture(scope="module")
def net() -> FedSTNet:
    return build_network(NetworkConfig())


def test_pinned_counts_agree_with_module_shapes(net):
    assert PINNED_PERSONAL["none"][1] == CHANNEL_SELECTION
    assert PINNED_PERSONAL["encoder_query"][0] == ENCODER_QUERY
    assert PINNED_PERSONAL["encoder_key_value"][0] == 2 * ENCODER_QUERY
    assert PINNED_PERSONAL["encoder_norm"][0] == ENCODER_NORM
    assert PINNED_PERSONAL["decoder_query"][0] == DECODER_QUERY
    assert PINNED_PERSONAL["encoder_decoder_query"][0] == ENCODER_QUERY + DECODER_QUERY
    assert sum(p.numel() for p in net.temporal.parameters()) == TEMPORAL
    assert sum(p.numel() for p in net.parameters()) == TOTAL


def test_there_is_one_preset_per_row_of_tables_v_and_vi():
    assert set(PRESETS) == set(PINNED_PERSONAL)


@pytest.mark.parametrize("preset", sorted(PINNED_PERSONAL))
@pytest.mark.parametrize("personalize_cs", [False, True])
def test_preset_personal_parameter_count_for_b0(net, preset, personalize_cs):
    part = split_state(net, PRESETS[preset], personalize_channel_selection=personalize_cs)
    assert count_parameters(net, part.personal) == PINNED_PERSONAL[preset][personalize_cs]
    assert count_parameters(net, part.shared) == TOTAL - PINNED_PERSONAL[preset][personalize_cs]


@pytest.mark.parametrize("preset", sorted(PINNED_PERSONAL))
def test_every_key_is_in_exactly_one_set(net, preset):
    part = split_state(net, PRESETS[preset])
    keys = [*part.personal, *part.shared, *part.fixed]
    assert len(keys) == len(set(keys))
    assert set(keys) == set(net.state_dict())


def test_fedst_default_personalizes_exactly_encoder_queries_and_channel_selection(net):
    part = split_state(net, PRESETS["encoder_query"], personalize_channel_selection=True)
    queries = {
        f"encoder.stages.{s}.blocks.{b}.attn.q.{p}"
        for s in range(4)
        for b in range(2)
        for p in ("weight", "bias")
    }
    assert set(part.personal) == queries | {
        "channel_selection.1.fc.weight",
        "channel_selection.1.fc.bias",
    }
    assert not any(k.startswith("temporal.") for k in part.personal)


@pytest.mark.parametrize(
    ("preset", "pattern"),
    [
        ("encoder_key", r"^encoder\.stages\.\d\.blocks\.\d\.attn\.k\.(weight|bias)$"),
        ("encoder_value", r"^encoder\.stages\.\d\.blocks\.\d\.attn\.v\.(weight|bias)$"),
        (
            "encoder_norm",
            r"^encoder\.(patch_embed\.|stages\.\d\.(downsample\.|blocks\.\d\.(attn\.)?)?)norm\d?\.(weight|bias)$",
        ),
        ("decoder_query", r"^decoder\.blocks\.0\.attn\.q\.(weight|bias)$"),
    ],
)
def test_preset_personal_keys_have_the_expected_form(net, preset, pattern):
    part = split_state(net, PRESETS[preset], personalize_channel_selection=False)
    assert part.personal
    assert all(re.fullmatch(pattern, k) for k in part.personal), part.personal


def test_fedavg_shares_everything_and_uploads_four_bytes_per_parameter():
    fedavg = build_network(NetworkConfig(temporal=False, prompt=False, channel_selection=False))
    part = split_state(fedavg, PRESETS["none"], personalize_channel_selection=False)
    assert part.personal == ()
    assert bytes_of(fedavg, part.shared) == 4 * count_parameters(fedavg, part.shared)


def test_a_rule_that_matches_nothing_is_an_error(net):
    with pytest.raises(ValueError, match="match no float key"):
        split_state(net, PartitionRules((r"^encoder\..*\.attn\.qq\.",)))
    with pytest.raises(ValueError, match="invalid regex"):
        PartitionRules(("attn.q(",))


def test_the_temporal_module_is_shared_unless_everything_is_personal(net):
    with pytest.raises(ValueError, match="temporal module is shared"):
        split_state(net, PartitionRules((r"\.q\.weight$",)))
    assert "temporal.1.q.weight" in split_state(net, PRESETS["all"]).personal


def test_non_float_buffers_are_fixed_never_shared():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    model.register_buffer("lookup", torch.arange(3))
    part = split_state(model, PRESETS["none"])
    assert set(part.fixed) == {"1.num_batches_tracked", "lookup"}
    assert "1.running_mean" in part.shared
