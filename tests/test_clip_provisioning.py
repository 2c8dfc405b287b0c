"""Specification of CLIP provisioning: one command builds, for every site an experiment touches,
the prompt cache that training then reads, with the model and tag training uses."""

from __future__ import annotations

from pathlib import Path

from fedst import weights
from fedst.cli import compose_experiment
from fedst.methods import method_of
from fedst.model import indicators

EVERY_TINY_SITE = ["A", "B", "C", "D", "E", "grasp", "synthetic"]  # configs/data/tiny.yaml


def test_prepare_builds_the_cache_training_reads_for_every_site(
    tmp_path: Path, monkeypatch, capsys
):
    overrides = [
        "experiment=tiny",
        "method.indicator=clip",
        "indicator.clip_pretrained=none",  # random open_clip weights: the real text path, offline
        f"indicator.cache_dir={tmp_path / 'cache'}",
    ]
    assert weights.main([*overrides, "--prepare"]) == 0
    printed = capsys.readouterr().out
    assert "[ok] CLIP text indicators: all 7 prompts cached" in printed

    def forbidden(*args, **kwargs):
        raise AssertionError("training had to embed a prompt: the prepared cache was not its cache")

    monkeypatch.setattr(indicators, "_encode_prompts", forbidden)
    cfg, _ = compose_experiment(overrides)
    assert sorted(method_of(cfg).indicators()) == sorted(EVERY_TINY_SITE)


def test_the_paper_experiment_and_the_cache_builder_use_one_clip_model_and_tag(
    tmp_path: Path, monkeypatch
):
    """The indicators CLI run without model options writes the file the paper run looks up."""
    cfg, _ = compose_experiment(["experiment=paper", f"indicator.cache_dir={tmp_path}"])
    seen: list[tuple[str, str]] = []

    def record(prompts, clip_model, clip_pretrained, cache_path, weights_dir):
        seen.append((clip_model, clip_pretrained))
        return {p: [1.0] + [0.0] * 511 for p in prompts}

    monkeypatch.setattr(indicators, "_encode_prompts", record)
    indicators.main(["--sites", "A:nephrectomy", "--out", str(tmp_path)])
    assert seen == [(cfg.indicator.clip_model, cfg.indicator.clip_pretrained)]


def test_prepare_without_clip_weights_reports_what_is_missing_and_the_fix(
    tmp_path: Path, monkeypatch, capsys
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FEDST_WEIGHTS_DIR", str(tmp_path / "weights"))
    code = weights.main(
        [
            "experiment=tiny",
            "method.indicator=clip",
            f"indicator.cache_dir={tmp_path / 'c'}",
            "--prepare",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 1
    assert "[MISSING] prepare: CLIP prompt cache not built" in printed
    assert "ViT-B-32_openai" in printed
    assert "--prepare" in printed
