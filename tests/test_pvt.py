"""Specification of models/pvt: split q/k/v PVTv2 encoder, checkpoint loading, weight lookup."""

from __future__ import annotations

import re
from pathlib import Path

import huggingface_hub
import pytest
import timm
import torch
from safetensors.torch import save_file

from models.pvt import (
    PVT_V2_VARIANTS,
    Attention,
    CheckpointMismatchError,
    WeightsNotFoundError,
    create_pvt_v2,
    describe_weights,
    load_pretrained,
    read_state_dict,
    resolve_pretrained,
    split_fused_kv,
)
from models.pvt import weights as weights_module

TINY = 64  # input side for b0 numerics tests
ATOL = 1e-5


def to_official_keys(timm_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm PVTv2 keys -> the official whai362/PVT release names (inverse of timm's filter)."""
    out = {}
    for key, value in timm_state.items():
        key = key.replace("patch_embed.", "patch_embed1.")
        key = re.sub(r"^stages\.(\d+)\.downsample\.", lambda m: f"patch_embed{int(m[1]) + 1}.", key)
        key = re.sub(r"^stages\.(\d+)\.blocks\.", lambda m: f"block{int(m[1]) + 1}.", key)
        key = re.sub(r"^stages\.(\d+)\.norm\.", lambda m: f"norm{int(m[1]) + 1}.", key)
        key = key.replace("mlp.dwconv.", "mlp.dwconv.dwconv.")
        out[key] = value
    return out


@pytest.fixture(scope="module")
def timm_b0() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("pvt_v2_b0", pretrained=False).eval()


@pytest.fixture(scope="module")
def timm_b0_maps(timm_b0: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    image = torch.randn(2, 3, TINY, TINY, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        maps = timm_b0.forward_intermediates(image, intermediates_only=True)
    return image, maps


@pytest.fixture
def offline_empty_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty weights dir, an empty HF cache and HF_HUB_OFFLINE=1."""
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    monkeypatch.setenv("FEDST_WEIGHTS_DIR", str(weights_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    return weights_dir


def _assert_same_maps(encoder: torch.nn.Module, image: torch.Tensor, expected: list[torch.Tensor]):
    with torch.no_grad():
        maps = encoder.eval()(image)
    assert len(maps) == 4
    for ours, theirs in zip(maps, expected, strict=True):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


CHECKPOINT_FORMATS = [
    ("timm", "plain", ".pth"),
    ("timm", "plain", ".safetensors"),
    ("official", "model", ".pth"),
    ("official", "state_dict", ".bin"),
    ("split", "plain", ".pt"),
]


@pytest.mark.parametrize(("key_style", "wrapper", "suffix"), CHECKPOINT_FORMATS)
def test_loaded_checkpoint_reproduces_timm_feature_maps(
    timm_b0, timm_b0_maps, tmp_path, key_style, wrapper, suffix
):
    image, expected = timm_b0_maps
    state = {k: v.clone() for k, v in timm_b0.state_dict().items()}
    if key_style == "official":
        state = to_official_keys(state)
    elif key_style == "split":
        first_load = create_pvt_v2("pvt_v2_b0")
        load_pretrained(first_load, state)
        state = first_load.state_dict()  # our own keys: attn.q / attn.k / attn.v
    path = tmp_path / f"checkpoint{suffix}"
    if suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state if wrapper == "plain" else {wrapper: state, "epoch": 3}, path)

    encoder = create_pvt_v2("pvt_v2_b0")
    report = load_pretrained(encoder, path)

    assert report.missing == [] and report.unexpected == []
    assert report.loaded == len(encoder.state_dict())
    _assert_same_maps(encoder, image, expected)


def test_official_checkpoint_is_detected_and_its_head_dropped_and_reported(timm_b0):
    official = to_official_keys(timm_b0.state_dict())
    assert "block1.0.attn.kv.weight" in official and "norm4.weight" in official

    report = load_pretrained(create_pvt_v2("pvt_v2_b0"), official)

    assert report.key_style == "official"
    assert report.dropped_head == ["head.bias", "head.weight"]
    assert report.missing == [] and report.unexpected == []


def test_fused_kv_rows_split_into_key_then_value():
    channels = 3
    weight = torch.arange(2 * channels * channels, dtype=torch.float32).reshape(2 * channels, -1)
    bias = torch.arange(2 * channels, dtype=torch.float32)
    state = {"block.attn.kv.weight": weight, "block.attn.kv.bias": bias, "block.attn.q.bias": bias}

    split = split_fused_kv(state)

    assert sorted(split) == [
        "block.attn.k.bias",
        "block.attn.k.weight",
        "block.attn.q.bias",
        "block.attn.v.bias",
        "block.attn.v.weight",
    ]
    assert torch.equal(split["block.attn.k.weight"], weight[:channels])
    assert torch.equal(split["block.attn.v.weight"], weight[channels:])
    assert torch.equal(split["block.attn.k.bias"], bias[:channels])
    assert torch.equal(split["block.attn.v.bias"], bias[channels:])


@pytest.mark.parametrize(("sr_ratio", "linear"), [(1, False), (2, False), (1, True)])
def test_split_attention_computes_what_timm_fused_attention_computes(sr_ratio, linear):
    torch.manual_seed(0)
    fused = timm.models.pvt_v2.Attention(16, num_heads=2, sr_ratio=sr_ratio, linear_attn=linear)
    tokens = torch.randn(2, 8 * 8, 16)

    split = Attention.from_timm(fused)

    assert {"q.weight", "k.weight", "v.weight"} <= set(split.state_dict())
    assert "kv.weight" not in split.state_dict()
    torch.testing.assert_close(split(tokens, (8, 8)), fused(tokens, (8, 8)), atol=ATOL, rtol=0)


def test_strict_load_names_missing_keys_and_partial_load_reports_them(timm_b0):
    state = dict(timm_b0.state_dict())
    del state["stages.3.norm.weight"]
    state["stages.0.blocks.2.attn.q.weight"] = torch.zeros(32, 32)  # a deeper variant's block

    with pytest.raises(CheckpointMismatchError, match=r"stages\.3\.norm\.weight"):
        load_pretrained(create_pvt_v2("pvt_v2_b0"), state)
    report = load_pretrained(create_pvt_v2("pvt_v2_b0"), state, strict=False)

    assert report.missing == ["stages.3.norm.weight"]
    assert report.unexpected == ["stages.0.blocks.2.attn.q.weight"]


def test_checkpoint_of_another_variant_fails_on_shapes_even_when_not_strict():
    torch.manual_seed(0)
    b1 = timm.create_model("pvt_v2_b1", pretrained=False, num_classes=0, device="meta")
    b1_state = b1.state_dict()

    with pytest.raises(CheckpointMismatchError, match=r"shape mismatch.*patch_embed\.proj\.weight"):
        load_pretrained(create_pvt_v2("pvt_v2_b0"), b1_state, strict=False)


def test_weights_file_with_unknown_suffix_is_rejected(tmp_path):
    path = tmp_path / "pvt_v2_b0.ckpt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"pvt_v2_b0\.ckpt.*\.safetensors"):
        read_state_dict(path)


@pytest.mark.parametrize("variant", PVT_V2_VARIANTS)
def test_every_variant_gives_four_maps_with_its_channels_and_named_qkv(variant):
    """Variants other than b0 are built on the meta device: shapes and names, no computation."""
    device = "cpu" if variant == "pvt_v2_b0" else "meta"
    reference = timm.create_model(variant, pretrained=False, num_classes=0, device="meta")

    encoder = create_pvt_v2(variant, device=device)
    with torch.no_grad():
        maps = encoder(torch.zeros(1, 3, 64, 96, device=device))

    expected_dims = tuple(info["num_chs"] for info in reference.feature_info)
    assert encoder.embed_dims == expected_dims
    assert [tuple(m.shape) for m in maps] == [
        (1, c, 64 // r, 96 // r) for c, r in zip(expected_dims, (4, 8, 16, 32), strict=True)
    ]
    assert sum(p.numel() for p in encoder.parameters()) == sum(
        p.numel() for p in reference.parameters()
    )
    names = [name for name, _ in encoder.named_parameters()]
    blocks = sum(reference.depths)
    for projection in ("q", "k", "v"):
        assert sum(f".attn.{projection}.weight" in n for n in names) == blocks
    assert not any(".attn.kv." in n or n.startswith("head.") for n in names)


def test_input_not_a_multiple_of_32_gives_ceil_sized_maps():
    encoder = create_pvt_v2("pvt_v2_b0").eval()
    with torch.no_grad():
        maps = encoder(torch.randn(1, 3, 36, 50))

    assert [tuple(m.shape[2:]) for m in maps] == [(9, 13), (5, 7), (3, 4), (2, 2)]
    assert encoder.feature_sizes(36, 50) == [(9, 13), (5, 7), (3, 4), (2, 2)]
    assert encoder.feature_sizes(128, 160) == [(32, 40), (16, 20), (8, 10), (4, 5)]
    assert encoder.feature_sizes(512, 640) == [(128, 160), (64, 80), (32, 40), (16, 20)]


def test_input_smaller_than_spatial_reduction_is_rejected_with_its_size():
    with pytest.raises(ValueError, match=r"\(28, 64\) is too small"):
        create_pvt_v2("pvt_v2_b0")(torch.zeros(1, 3, 28, 64))


def test_missing_weights_raise_naming_directory_files_and_sources(
    offline_empty_weights, monkeypatch
):
    def no_network(*args, **kwargs):
        raise AssertionError("the hub must not be contacted when HF_HUB_OFFLINE is set")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", no_network)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)

    with pytest.raises(WeightsNotFoundError) as raised:
        create_pvt_v2("pvt_v2_b0", pretrained=True)

    message = str(raised.value)
    for expected in (
        str(offline_empty_weights),
        "pvt_v2_b0.pth",
        "pvt_v2_b0.safetensors",
        "timm/pvt_v2_b0.in1k",
        "github.com/whai362/PVT/releases",
        "pretrained: false",
        "HF_HUB_OFFLINE",
    ):
        assert expected in message


def test_unreachable_hub_is_probed_once_with_a_short_timeout_and_never_downloaded(
    offline_empty_weights, monkeypatch
):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    probes = []
    real_probe = huggingface_hub.get_hf_file_metadata

    def counting_probe(url, **kwargs):
        probes.append(kwargs)
        return real_probe(url, **kwargs)

    def no_download(*args, **kwargs):
        raise AssertionError("no download after a failed probe")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", counting_probe)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_download)

    with pytest.raises(WeightsNotFoundError, match=r"hub probe .*127\.0\.0\.1:9.* failed"):
        resolve_pretrained("pvt_v2_b0", True)

    assert len(probes) == 1
    assert probes[0]["timeout"] <= weights_module.HUB_PROBE_TIMEOUT_S <= 10
    assert probes[0].get("retry_on_errors", False) is False


def test_weights_in_the_weights_dir_are_found_described_and_loaded(
    offline_empty_weights, timm_b0, timm_b0_maps
):
    assert "NOT FOUND" in describe_weights("pvt_v2_b0")
    path = offline_empty_weights / "pvt_v2_b0.pth"
    torch.save(to_official_keys(timm_b0.state_dict()), path)

    assert resolve_pretrained("pvt_v2_b0", True) == path
    assert describe_weights("pvt_v2_b0") == f"pvt_v2_b0: {path} (weights directory)"
    image, expected = timm_b0_maps
    _assert_same_maps(create_pvt_v2("pvt_v2_b0", pretrained=True), image, expected)


def test_explicit_weights_file_that_does_not_exist_is_an_error_naming_it(tmp_path):
    missing = tmp_path / "nowhere" / "b0.pth"
    with pytest.raises(WeightsNotFoundError, match=re.escape(str(missing))):
        create_pvt_v2("pvt_v2_b0", pretrained=missing)


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"pvt_v2_b9.*pvt_v2_b0"):
        create_pvt_v2("pvt_v2_b9")
