"""Specification of the frozen site indicators xi_k (paper Sec. III-B2, Table VII)."""

import math
from pathlib import Path

import open_clip
import pytest
import torch

from fedst.model import indicators
from fedst.model.indicators import (
    IndicatorUnavailableError,
    clip_cache_path,
    site_indicators,
    site_prompt,
)

SITES = [("A", "nephrectomy"), ("B", "nephrectomy"), ("E", "lobectomy")]


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("kind", ["onehot", "gaussian", "random"])
def test_every_kind_gives_one_float_vector_of_dim_per_site(kind):
    out = site_indicators(kind, SITES, dim=64)
    assert list(out) == ["A", "B", "E"]
    assert all(v.shape == (64,) and v.dtype == torch.float32 for v in out.values())


def test_onehot_indicators_are_orthonormal_and_follow_site_order():
    out = site_indicators("onehot", SITES[:2], dim=8, site_order=["E", "B", "A"])
    stacked = torch.stack([out["A"], out["B"]])
    assert torch.equal(stacked @ stacked.T, torch.eye(2))
    assert out["A"][2] == 1 and out["B"][1] == 1


def test_gaussian_indicator_matches_the_formula():
    # 3 sites, dim 11: x_j = j / 10, site B has id 1 -> mu = 0.5, sigma = 0.1.
    xi = site_indicators("gaussian", SITES, dim=11)["B"]
    assert xi[5].item() == pytest.approx(1.0)
    assert xi[6].item() == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert xi[3].item() == pytest.approx(math.exp(-2.0), rel=1e-6)
    assert site_indicators("gaussian", SITES, dim=11)["A"][0].item() == pytest.approx(1.0)


def test_random_indicator_is_reproducible_per_site_and_seed():
    first = site_indicators("random", SITES, dim=32)
    again = site_indicators("random", list(reversed(SITES)), dim=32)
    other_seed = site_indicators("random", SITES, dim=32, seed=1)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["A"], first["B"])
    assert not torch.equal(first["A"], other_seed["A"])
    assert first["A"].norm().item() == pytest.approx(1.0)


def test_unknown_kind_and_site_missing_from_order_are_errors():
    with pytest.raises(ValueError, match="unknown indicator kind"):
        site_indicators("bert", SITES)
    with pytest.raises(ValueError, match="not in site_order"):
        site_indicators("onehot", SITES, site_order=["A"])


@pytest.fixture(scope="module")
def clip_cache(tmp_path_factory) -> Path:
    """A cache made with the real open_clip text path and randomly initialised weights."""
    cache_dir = tmp_path_factory.mktemp("clip_cache")
    site_indicators("clip", SITES, clip_pretrained="none", cache_dir=cache_dir)
    return cache_dir


def test_clip_indicators_are_unit_text_embeddings_written_to_the_cache(clip_cache):
    path = clip_cache_path(clip_cache, "ViT-B-32", "none")
    assert path.name == "clip_text_ViT-B-32_none.json"
    assert path.is_file()
    out = site_indicators("clip", SITES, clip_pretrained="none", cache_dir=clip_cache)
    assert all(v.shape == (512,) for v in out.values())
    assert all(v.norm().item() == pytest.approx(1.0, abs=1e-5) for v in out.values())
    assert not torch.allclose(out["A"], out["E"])
    cached = path.read_text()
    assert site_prompt("E", "lobectomy") in cached
    assert "This is the Local site A model and the surgery type is nephrectomy" in cached


def test_second_clip_call_reads_the_cache_without_building_clip(clip_cache, monkeypatch):
    first = site_indicators("clip", SITES, clip_pretrained="none", cache_dir=clip_cache)

    def forbidden(*args, **kwargs):
        raise AssertionError("CLIP must not be constructed when the cache has the prompt")

    monkeypatch.setattr(open_clip, "create_model", forbidden)
    again = site_indicators("clip", SITES, clip_pretrained="none", cache_dir=clip_cache)
    assert all(torch.equal(first[n], again[n]) for n in first)


def test_clip_embedding_dim_must_match_the_indicator_dim(clip_cache):
    with pytest.raises(ValueError, match="indicator_dim"):
        site_indicators("clip", SITES, dim=256, clip_pretrained="none", cache_dir=clip_cache)


def test_missing_pretrained_clip_offline_raises_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def forbidden(*args, **kwargs):
        raise AssertionError("no CLIP model may be built without its weights (no fallback)")

    monkeypatch.setattr(open_clip, "create_model", forbidden)
    with pytest.raises(IndicatorUnavailableError) as info:
        site_indicators("clip", SITES, cache_dir=tmp_path / "cache", weights_dir=tmp_path / "w")
    message = str(info.value)
    assert str(tmp_path / "w" / "open_clip" / "ViT-B-32_openai.bin") in message
    assert "timm/vit_base_patch32_clip_224.openai" in message
    assert "python -m fedst.weights experiment=<your experiment> --prepare" in message
    assert "indicator: onehot" in message
    assert not (tmp_path / "cache").exists()


def test_cli_prints_the_cached_indicators(clip_cache, capsys):
    indicators.main(
        ["--sites", "A:nephrectomy", "--out", str(clip_cache), "--clip-pretrained", "none"]
    )
    printed = capsys.readouterr().out
    assert "A: dim 512 norm 1.0000" in printed
    assert "clip_text_ViT-B-32_none.json" in printed
