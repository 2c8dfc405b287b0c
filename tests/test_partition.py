"""Specification of the personalized / shared parameter split (Sec. III-B1; Tables V, VI).

Expected key sets and counts are derived here from the architecture (PVTv2-b0: embed dims
(32, 64, 160, 256), depths (2, 2, 2, 2), spatial-reduction ratios (8, 4, 2, 1); a 128-channel
decoder with one attention block; channel selection at stage 1), not from the partition rules.
"""

import pytest
import torch
from torch import nn

from fedst.model.network import FedSTNet, NetworkConfig, build_network
from fedst.model.partition import (
    PRESETS,
    PartitionRules,
    bytes_of,
    component_rules,
    count_parameters,
    split_state,
)

B0_DIMS = (32, 64, 160, 256)
B0_DEPTHS = (2, 2, 2, 2)
B0_SR_RATIOS = (8, 4, 2, 1)
DECODER_DIM = 128
DECODER_ATTENTION_BLOCKS = 1
CS_STAGE, INDICATOR_DIM = 1, 512


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


# -- expected key sets, one per kind of layer a table row names --------------------------------


def weight_and_bias(*modules: str) -> set[str]:
    return {f"{m}.{p}" for m in modules for p in ("weight", "bias")}


def encoder_attention(projection: str) -> set[str]:
    """Every encoder block's attention ``projection`` (q, k or v): 4 stages x 2 blocks."""
    return weight_and_bias(
        *(
            f"encoder.stages.{s}.blocks.{b}.attn.{projection}"
            for s, depth in enumerate(B0_DEPTHS)
            for b in range(depth)
        )
    )


def encoder_layer_norms(net: nn.Module) -> set[str]:
    """Every nn.LayerNorm of the encoder, found by module type (not by name)."""
    return weight_and_bias(
        *(
            f"encoder.{name}"
            for name, m in net.encoder.named_modules()
            if isinstance(m, nn.LayerNorm)
        )
    )


DECODER_QUERY_KEYS = weight_and_bias(
    *(f"decoder.blocks.{i}.attn.q" for i in range(DECODER_ATTENTION_BLOCKS))
)
CHANNEL_SELECTION_KEYS = weight_and_bias(f"channel_selection.{CS_STAGE}.fc")


def float_keys(net: nn.Module) -> set[str]:
    return {k for k, v in net.state_dict().items() if v.is_floating_point()}


# Tables V and VI, as the paper words each row -> the personalized layers (excluding CS).
TABLE_ROWS = {
    "Table V row 1 (all shared)": ("none", lambda net: set()),
    "Table V row 2 (all personalized)": ("all", float_keys),
    "Table V row 3 (decoder Attn.q)": ("decoder_query", lambda net: DECODER_QUERY_KEYS),
    "Table V row 4 (encoder + decoder Attn.q)": (
        "encoder_decoder_query",
        lambda net: encoder_attention("q") | DECODER_QUERY_KEYS,
    ),
    "Table V row 5 / VI Ours (encoder Attn.q)": (
        "encoder_query",
        lambda net: encoder_attention("q"),
    ),
    "Table VI Norm": ("encoder_norm", encoder_layer_norms),
    "Table VI Key": ("encoder_key", lambda net: encoder_attention("k")),
    "Table VI Value": ("encoder_value", lambda net: encoder_attention("v")),
    "Table VI Key&Value": (
        "encoder_key_value",
        lambda net: encoder_attention("k") | encoder_attention("v"),
    ),
    "Table IX reading (RSC private)": (
        "rsc",
        lambda net: (
            encoder_attention("q") | {k for k in float_keys(net) if k.startswith("temporal.")}
        ),
    ),
}

# Parameter counts from the b0 shapes alone.
ENCODER_ATTENTION_PROJECTION = sum(
    depth * linear(c, c) for c, depth in zip(B0_DIMS, B0_DEPTHS, strict=True)
)
ENCODER_NORM = sum(
    2 * c * (2 + depth * (2 + (sr > 1)))  # patch-embed norm, stage norm; per block norm1, norm2,
    for c, depth, sr in zip(B0_DIMS, B0_DEPTHS, B0_SR_RATIOS, strict=True)  # sr norm (sr > 1)
)
DECODER_QUERY = DECODER_ATTENTION_BLOCKS * linear(DECODER_DIM, DECODER_DIM)
CHANNEL_SELECTION = linear(B0_DIMS[CS_STAGE] + INDICATOR_DIM, B0_DIMS[CS_STAGE])


def cffm_block(channels: int, heads: int) -> int:
    """Scalars of CFFM's cross-frame block at ``channels`` (s = 7; issue 58)."""
    return (
        2 * 2 * channels  # norm1, norm2
        + 4 * linear(channels, channels)  # q, k, v, proj
        + linear(channels, 4 * channels)
        + linear(4 * channels, channels)  # MLP, ratio 4
        + sum(
            linear(cells, 1) for cells in (49, 49, 9, 4)
        )  # pooling: current per window; g = 7, 3, 2
        + heads
        * ((2 * 7 - 1) ** 2 + 49 * 132 + (7 + 5 - 1) ** 2)  # B: window, ring, pooled current
        + heads
        * sum((7 + k - 1) ** 2 for k in (7, 5, 3))  # B: one relative table per earlier frame
    )


TEMPORAL = cffm_block(64, heads=2)
"""The encoder placement's module: CFFM's block at stage 1 (64 channels, 2 heads of 32)."""
TEMPORAL_DECODE_HEAD = cffm_block(DECODER_DIM, heads=DECODER_DIM // 32) + 2 * DECODER_DIM * 4 + 4
"""The decode-head placement's (the default): the block on the decoder's fused map (4 heads of
32) and CFFM's ``linear_pred2``, a 1x1 conv from [before, after] (2 x 128 channels) to 4 classes."""

EXPECTED_COUNT = {  # personal scalars without channel selection; "all" is checked separately
    "none": 0,
    "encoder_query": ENCODER_ATTENTION_PROJECTION,
    "encoder_key": ENCODER_ATTENTION_PROJECTION,
    "encoder_value": ENCODER_ATTENTION_PROJECTION,
    "encoder_key_value": 2 * ENCODER_ATTENTION_PROJECTION,
    "encoder_norm": ENCODER_NORM,
    "decoder_query": DECODER_QUERY,
    "encoder_decoder_query": ENCODER_ATTENTION_PROJECTION + DECODER_QUERY,
    "rsc": ENCODER_ATTENTION_PROJECTION + TEMPORAL,
}


@pytest.fixture(scope="module")
def net() -> FedSTNet:
    """The encoder placement: its temporal module is named by stage (``temporal.1.*``)."""
    return build_network(NetworkConfig(temporal_placement="encoder"))


def scalars(net: nn.Module, keys) -> int:
    state = net.state_dict()
    return sum(state[k].numel() for k in keys)


def test_there_is_one_preset_per_row_of_tables_v_and_vi_and_the_table_ix_reading():
    assert set(PRESETS) == {preset for preset, _ in TABLE_ROWS.values()}


@pytest.mark.parametrize("row", sorted(TABLE_ROWS))
@pytest.mark.parametrize("personalize_cs", [False, True])
def test_each_table_row_personalizes_exactly_the_layers_it_names(net, row, personalize_cs):
    preset, layers = TABLE_ROWS[row]
    part = split_state(net, PRESETS[preset], personalize_channel_selection=personalize_cs)
    expected = layers(net) | (CHANNEL_SELECTION_KEYS if personalize_cs else set())
    if preset == "all":
        expected = float_keys(net)
    assert set(part.personal) == expected
    assert set(part.shared) == float_keys(net) - expected


@pytest.mark.parametrize("preset", sorted(EXPECTED_COUNT))
@pytest.mark.parametrize("personalize_cs", [False, True])
def test_preset_personal_parameter_count_follows_the_b0_shapes(net, preset, personalize_cs):
    part = split_state(net, PRESETS[preset], personalize_channel_selection=personalize_cs)
    expected = EXPECTED_COUNT[preset] + (CHANNEL_SELECTION if personalize_cs else 0)
    assert count_parameters(net, part.personal) == expected
    assert count_parameters(net, part.shared) == scalars(net, float_keys(net)) - expected


def test_the_temporal_module_has_cffm_s_parameter_count(net):
    assert sum(p.numel() for p in net.temporal.parameters()) == TEMPORAL
    decode_head = build_network(NetworkConfig())  # the default placement
    assert sum(p.numel() for p in decode_head.temporal.parameters()) == TEMPORAL_DECODE_HEAD


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("personalize_cs", [False, True])
def test_personal_shared_and_fixed_are_disjoint_and_cover_the_state_dict(
    net, preset, personalize_cs
):
    part = split_state(net, PRESETS[preset], personalize_channel_selection=personalize_cs)
    keys = [*part.personal, *part.shared, *part.fixed]
    assert len(keys) == len(set(keys))
    assert set(keys) == set(net.state_dict())
    assert set(part.fixed) == set(net.state_dict()) - float_keys(net)


def test_fedst_default_personalizes_exactly_encoder_queries_and_channel_selection(net):
    part = split_state(net, PRESETS["encoder_query"], personalize_channel_selection=True)
    assert set(part.personal) == encoder_attention("q") | CHANNEL_SELECTION_KEYS
    assert not any(k.startswith("temporal.") for k in part.personal)


def test_fedavg_shares_everything_and_uploads_four_bytes_per_parameter():
    fedavg = build_network(NetworkConfig(temporal=False, prompt=False, channel_selection=False))
    part = split_state(fedavg, PRESETS["none"], personalize_channel_selection=False)
    assert part.personal == ()
    float_buffers = sum(b.numel() for b in fedavg.buffers() if b.is_floating_point())
    values = sum(p.numel() for p in fedavg.parameters()) + float_buffers
    assert bytes_of(fedavg, part.shared) == 4 * values


def test_a_rule_that_matches_nothing_is_an_error(net):
    with pytest.raises(ValueError, match="match no float key"):
        split_state(net, PartitionRules((r"^encoder\..*\.attn\.qq\.",)))
    with pytest.raises(ValueError, match="invalid regex"):
        PartitionRules(("attn.q(",))


def test_the_temporal_module_is_shared_or_private_as_a_whole(net):
    with pytest.raises(ValueError, match="temporal module is shared or private as a whole"):
        split_state(net, PartitionRules((r"\.q\.weight$",)))
    assert "temporal.1.q.weight" in split_state(net, PRESETS["all"]).personal
    rsc = split_state(net, PRESETS["rsc"])
    assert not any(k.startswith("temporal.") for k in rsc.shared)


def test_non_float_buffers_are_fixed_never_shared():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    model.register_buffer("lookup", torch.arange(3))
    part = split_state(model, PRESETS["none"])
    assert set(part.fixed) == {"1.num_batches_tracked", "lookup"}
    assert "1.running_mean" in part.shared


def test_a_component_not_shared_stays_private_whole(net):
    """shared_components=[encoder]: temporal module, decoder, head and CS stay at the site."""
    rules = PartitionRules(component_rules(net, ["encoder"]))
    part = split_state(net, rules, personalize_channel_selection=False)
    encoder = {k for k in float_keys(net) if k.startswith("encoder.")}
    assert set(part.shared) == encoder
    assert set(part.personal) == float_keys(net) - encoder
    with pytest.raises(ValueError, match="unknown component"):
        component_rules(net, ["encoder", "neck"])
