"""Which pretrained weights an experiment needs, and whether they are here (no network access).

    python -m fedst.weights                       # what experiment=paper needs
    python -m fedst.weights experiment=demo method=fedst method.indicator=clip

Looks for the PVTv2 ImageNet checkpoint of the configured encoder (models/pvt/weights.py: the
weights directory, $FEDST_WEIGHTS_DIR, the Hugging Face cache) and, when the method uses CLIP
text indicators, for the cached embedding of every site prompt or else the open_clip checkpoint
(fedst/model/indicators.py). Exit code 0 when everything the experiment needs is present, 1 otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedst.cli import compose_experiment
from fedst.experiment import ExperimentConfig
from fedst.federation.components import site_order
from fedst.model.indicators import clip_cache_path, site_prompt
from models.pvt.weights import (
    describe_weights,
    find_in_hf_cache,
    local_candidates,
    weights_directory,
)


def encoder_status(cfg: ExperimentConfig) -> tuple[bool, str]:
    """(needed weights present, one-line description) for the encoder."""
    network = cfg.network
    if network.pretrained is False:
        return (
            True,
            f"encoder {network.encoder}: random init (network.pretrained=false), no file needed",
        )
    if isinstance(network.pretrained, str):
        path = Path(network.pretrained)
        return (
            path.is_file(),
            f"encoder {network.encoder}: configured file {path} ({'found' if path.is_file() else 'MISSING'})",
        )
    found = any(p.is_file() for p in local_candidates(network.encoder, network.weights_dir)) or (
        find_in_hf_cache(network.encoder) is not None
    )
    return found, describe_weights(network.encoder, network.weights_dir)


def clip_status(cfg: ExperimentConfig) -> tuple[bool, str]:
    """(every site prompt has a cached embedding or CLIP weights are local, description)."""
    if not cfg.uses_indicator() or cfg.method.indicator != "clip":
        return (
            True,
            f"site indicator: {cfg.method.indicator if cfg.uses_indicator() else 'none'} (no CLIP needed)",
        )
    ind = cfg.indicator
    cache = clip_cache_path(Path(ind.cache_dir), ind.clip_model, ind.clip_pretrained)
    prompts = [site_prompt(s, cfg.data.sites[s].surgery_type) for s in site_order(cfg)]
    cached = json.loads(cache.read_text()) if cache.is_file() else {}
    missing = [p for p in prompts if p not in cached]
    local = weights_directory(None) / "open_clip"
    checkpoints = (
        sorted(local.glob(f"{ind.clip_model}_{ind.clip_pretrained}.*")) if local.is_dir() else []
    )
    if not missing:
        return True, f"CLIP text indicators: all {len(prompts)} prompts cached in {cache}"
    if checkpoints:
        return (
            True,
            f"CLIP text indicators: {len(missing)} prompt(s) to embed with {checkpoints[0]}",
        )
    return False, (
        f"CLIP text indicators: {len(missing)} of {len(prompts)} prompts not cached in {cache} and no "
        f"checkpoint {local}/{ind.clip_model}_{ind.clip_pretrained}.(safetensors|bin|pt); run "
        f"`python -m fedst.model.indicators` where CLIP is available and copy the cache file"
    )


def main(argv: list[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if not any(o.startswith("experiment=") for o in overrides):
        overrides.insert(0, "experiment=paper")
    cfg, _ = compose_experiment(overrides)
    results = [encoder_status(cfg), clip_status(cfg)]
    for ok, line in results:
        print(f"[{'ok' if ok else 'MISSING'}] {line}")
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
