"""Which pretrained weights an experiment needs, whether they are here, and preparing them.

    python -m fedst.weights                                   # what experiment=paper needs
    python -m fedst.weights experiment=paper --prepare        # also build its CLIP prompt cache
    python -m fedst.weights experiment=demo method.indicator=clip
    python -m fedst.weights --run runs/demo/fedst_s0_... --extra-site lung:lobectomy --prepare

Looks for the PVTv2 ImageNet checkpoint of the configured encoder (models/pvt/weights.py: the
weights directory, $FEDST_WEIGHTS_DIR, the Hugging Face cache) and, when the method uses CLIP
text indicators, for the cached embedding of the prompt of every site the experiment touches
(federation, out-of-federation and server sites) or else the open_clip checkpoint
(fedst/model/indicators.py). ``--prepare`` builds the missing embeddings with the code path
training uses (fedst.methods.Method.indicators: same model, tag, cache folder and
prompts), so the cache it writes is the one training reads; without local or downloadable CLIP
weights it says what is missing and how to provide it. ``--run RUN_DIR`` reads the experiment of a
finished run (its config.json) instead of composing one; ``--extra-site NAME:SURGERY_TYPE``
(repeatable) adds the prompt of a site the experiment does not list, as eval_outfed.py's
``site_root=`` prompts a new site (fedst.runs.outfed.new_site_indicator). Exit code 0 when everything
the experiment needs is present, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
from pathlib import Path

from fedst.cli import compose_experiment
from fedst.config import ConfigError
from fedst.errors import ArgumentParser
from fedst.experiment import ExperimentConfig, experiment_from_json
from fedst.methods import method_of
from fedst.model.indicators import (
    IndicatorUnavailableError,
    clip_cache_path,
    site_indicators,
    site_prompt,
)
from fedst.runs.layout import CONFIG_JSON
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


def clip_status(
    cfg: ExperimentConfig, extra_sites: list[tuple[str, str]] | None = None
) -> tuple[bool, str]:
    """(every site prompt has a cached embedding or CLIP weights are local, description);
    ``extra_sites``: (name, surgery type) of sites outside the experiment whose prompts count too."""
    if not cfg.uses_indicator() or cfg.method.indicator != "clip":
        return (
            True,
            f"site indicator: {cfg.method.indicator if cfg.uses_indicator() else 'none'} (no CLIP needed)",
        )
    ind = cfg.indicator
    cache = clip_cache_path(Path(ind.cache_dir), ind.clip_model, ind.clip_pretrained)
    prompts = [site_prompt(s, cfg.data.sites[s].surgery_type) for s in method_of(cfg).site_order()]
    prompts += [site_prompt(name, surgery) for name, surgery in extra_sites or []]
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
        f"`python -m fedst.weights {' '.join(_overrides_hint(cfg, extra_sites))} --prepare` where "
        f"CLIP is "
        f"available (or add --prepare here once the checkpoint is in place) and copy the cache file"
    )


def _overrides_hint(
    cfg: ExperimentConfig, extra_sites: list[tuple[str, str]] | None = None
) -> list[str]:
    return [f"experiment={cfg.name}"] + [
        f"--extra-site {shlex.quote(f'{n}:{s}')}" for n, s in extra_sites or []
    ]


def prepare_clip(
    cfg: ExperimentConfig, extra_sites: list[tuple[str, str]] | None = None
) -> tuple[bool, str]:
    """Build the CLIP prompt cache exactly as training (Method.indicators) and a new site's
    evaluation (site_indicators with the run's model, tag and cache folder) will read it."""
    if not cfg.uses_indicator() or cfg.method.indicator != "clip":
        return True, "prepare: the method uses no CLIP indicator; nothing to build"
    ind = cfg.indicator
    try:
        vectors = method_of(cfg).indicators()
        if extra_sites:
            vectors |= site_indicators(
                "clip",
                extra_sites,
                dim=ind.dim,
                clip_model=ind.clip_model,
                clip_pretrained=ind.clip_pretrained,
                cache_dir=Path(ind.cache_dir),
            )
    except IndicatorUnavailableError as err:
        return False, f"prepare: CLIP prompt cache not built. {err}"
    cache = clip_cache_path(Path(ind.cache_dir), ind.clip_model, ind.clip_pretrained)
    return True, f"prepare: {len(vectors)} site prompts ({', '.join(vectors)}) cached in {cache}"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m fedst.weights",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides as for train_fed.py (default experiment=paper)",
    )
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="build the CLIP text embeddings of every site prompt the experiment needs",
    )
    parser.add_argument(
        "--run",
        type=Path,
        default=None,
        help="a run directory: use its experiment (config.json) instead of overrides",
    )
    parser.add_argument(
        "--extra-site",
        action="append",
        default=[],
        metavar="NAME:SURGERY_TYPE",
        help="also the prompt of a site outside the experiment (eval_outfed.py site_root=...)",
    )
    return parser


def _parse_extra_sites(values: list[str]) -> list[tuple[str, str]]:
    sites = []
    for value in values:
        name, _, surgery = value.partition(":")
        if not name or not surgery:
            raise ConfigError(
                f"--extra-site {value!r}: write NAME:SURGERY_TYPE, e.g. lung:lobectomy"
            )
        sites.append((name, surgery))
    return sites


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    extra_sites = _parse_extra_sites(args.extra_site)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.run is not None:
        if args.overrides:
            raise ConfigError(f"--run {args.run} uses the run's own config: drop {args.overrides}")
        path = args.run / CONFIG_JSON
        if not path.is_file():
            raise ConfigError(f"{path} is missing: --run takes a run directory of train_fed.py")
        cfg = experiment_from_json(path.read_text())
    else:
        overrides = list(args.overrides)
        if not any(o.startswith("experiment=") for o in overrides):
            overrides.insert(0, "experiment=paper")
        cfg, _ = compose_experiment(overrides)
    results = [encoder_status(cfg)]
    if args.prepare:
        results.append(prepare_clip(cfg, extra_sites))
    results.append(clip_status(cfg, extra_sites))
    for ok, line in results:
        print(f"[{'ok' if ok else 'MISSING'}] {line}")
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    from fedst.errors import run_entry_point

    run_entry_point(main, "python -m fedst.weights")
