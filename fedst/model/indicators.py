"""Frozen site indicators xi_k for channel selection (paper Sec. III-B2, Table VII).

Kinds, all of one dimension ``dim`` so the rows of Table VII differ only in content:

* ``clip``: the open_clip text embedding of :data:`PROMPT_TEMPLATE` (the paper's prompt),
  L2-normalised. Computed once with the CLIP **text tower only** and cached in a small JSON file
  ``<cache_dir>/clip_text_<model>_<pretrained>.json`` (prompt -> vector); later calls read the cache
  and never construct CLIP. ``clip_pretrained="none"`` builds a randomly initialised CLIP
  (explicit; for tests) and is cached under its own key "none".
* ``onehot``: e_{id(k)}, with the site id from ``site_order``.
* ``gaussian``: Sec. IV-C4, "a Gaussian centred at the one-hot value of each site, sigma 0.1".
  Exact reading: x_j = j / (dim - 1) (coordinate j normalised to [0, 1]),
  mu_k = id(k) / (N - 1) for N sites in ``site_order`` (mu = 0 for a single site), and
  xi[j] = exp(-(x_j - mu_k)^2 / (2 * 0.1^2)): a smooth bump whose peak sits where site k's one-hot
  coordinate would be if the N one-hot slots were spread over the embedding.
* ``random``: a fixed standard-normal vector per site, L2-normalised, from a generator seeded
  with ``seed + zlib.crc32(site name)`` (stable across processes, unlike Python's ``hash``).

If the CLIP cache lacks a prompt and the pretrained weights are neither local
(``<weights dir>/open_clip/<model>_<tag>.(safetensors|bin|pt)``, weights dir = the argument, else
$FEDST_WEIGHTS_DIR, else weights/, as for the encoder; or the Hugging Face cache) nor fetchable
(HF_HUB_OFFLINE=1, or the hub does not answer a 3 s connection probe),
:class:`IndicatorUnavailableError` says how to provide them. No other kind is ever substituted.

Provisioning: ``python -m fedst.weights experiment=paper --prepare`` embeds the prompt of every
site the experiment touches (federation, out-of-federation and server sites) with the experiment's
own model, tag and cache folder, i.e. writes exactly the cache training reads, and reports what is
still missing. Run it where the CLIP weights are (or can be downloaded), then copy the cache file.
The lower-level CLI below embeds an explicit list of sites (defaults: the ones above):
``python -m fedst.model.indicators --sites A:nephrectomy B:nephrectomy --out weights/clip_cache``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import urllib.parse
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from fedst.errors import ArgumentParser, UserError
from fedst.schema.indicators import DEFAULT_CLIP_MODEL, DEFAULT_CLIP_PRETRAINED, INDICATOR_KINDS
from models.pvt.weights import weights_directory

__all__ = [
    "INDICATOR_KINDS",
    "PROMPT_TEMPLATE",
    "IndicatorUnavailableError",
    "clip_cache_path",
    "clip_text_embeddings",
    "site_indicators",
    "site_prompt",
]

log = logging.getLogger(__name__)

PROMPT_TEMPLATE = "This is the Local site {site} model and the surgery type is {surgery_type}"
GAUSSIAN_SIGMA = 0.1
DEFAULT_CACHE_DIR = Path("weights/clip_cache")
HUB_PROBE_TIMEOUT_S = 3.0
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt")


class IndicatorUnavailableError(UserError, RuntimeError):
    """The requested site indicator cannot be computed here; the message says how to fix it."""


def site_prompt(site: str, surgery_type: str) -> str:
    """The paper's text prompt for one site."""
    return PROMPT_TEMPLATE.format(site=site, surgery_type=surgery_type)


def clip_cache_path(cache_dir: Path, clip_model: str, clip_pretrained: str) -> Path:
    """Cache file for one (model, pretrained tag) pair; prompts are the keys inside."""
    safe = f"{clip_model}_{clip_pretrained}".replace("/", "-").replace(os.sep, "-")
    return Path(cache_dir) / f"clip_text_{safe}.json"


def site_indicators(
    kind: str,
    sites: Sequence[tuple[str, str]],
    dim: int = 512,
    site_order: Sequence[str] | None = None,
    clip_model: str = DEFAULT_CLIP_MODEL,
    clip_pretrained: str = DEFAULT_CLIP_PRETRAINED,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    weights_dir: Path | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Indicator xi_k [dim] (float32, frozen) for every ``(name, surgery_type)`` in ``sites``.

    ``site_order`` fixes the site ids of ``onehot`` / ``gaussian`` (pass every site name of the
    study, including out-of-federation ones); by default the order of ``sites``.
    """
    if kind not in INDICATOR_KINDS:
        raise ValueError(f"unknown indicator kind {kind!r}; choose one of {INDICATOR_KINDS}")
    if dim <= 0:
        raise ValueError(f"indicator dim must be positive, got {dim}")
    names = [name for name, _ in sites]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate site names in {names}")
    order = list(site_order) if site_order is not None else names
    if kind == "clip":
        prompts = [site_prompt(name, surgery) for name, surgery in sites]
        vectors = clip_text_embeddings(prompts, clip_model, clip_pretrained, cache_dir, weights_dir)
        out = dict(zip(names, vectors, strict=True))
        got = {v.numel() for v in out.values()}
        if got != {dim}:
            raise ValueError(
                f"CLIP model {clip_model} gives {sorted(got)}-d embeddings but indicator "
                f"dim={dim}; set indicator_dim to {sorted(got)[0]} or choose another clip_model"
            )
        return out
    if kind == "random":
        return {name: _random_indicator(name, dim, seed) for name in names}
    missing = [name for name in names if name not in order]
    if missing:
        raise ValueError(f"sites {missing} are not in site_order {order}; add them to it")
    if len(order) > dim and kind == "onehot":
        raise ValueError(f"onehot indicators need dim >= number of sites ({len(order)}), got {dim}")
    if kind == "onehot":
        return {name: _onehot(order.index(name), dim) for name in names}
    return {name: _gaussian(order.index(name), len(order), dim) for name in names}


def _onehot(site_id: int, dim: int) -> torch.Tensor:
    vector = torch.zeros(dim)
    vector[site_id] = 1.0
    return vector


def _gaussian(
    site_id: int, num_sites: int, dim: int, sigma: float = GAUSSIAN_SIGMA
) -> torch.Tensor:
    """xi[j] = exp(-(x_j - mu)^2 / (2 sigma^2)), x_j = j/(dim-1), mu = id/(N-1)."""
    coords = torch.linspace(0.0, 1.0, dim, dtype=torch.float64)
    mu = site_id / (num_sites - 1) if num_sites > 1 else 0.0
    return torch.exp(-((coords - mu) ** 2) / (2.0 * sigma**2)).float()


def _random_indicator(name: str, dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode("utf-8")))
    vector = torch.randn(dim, generator=generator)
    return vector / vector.norm()


def clip_text_embeddings(
    prompts: Sequence[str],
    clip_model: str = DEFAULT_CLIP_MODEL,
    clip_pretrained: str = DEFAULT_CLIP_PRETRAINED,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    weights_dir: Path | None = None,
) -> list[torch.Tensor]:
    """L2-normalised CLIP text embeddings [D] of ``prompts``, read from / added to the cache."""
    path = clip_cache_path(cache_dir, clip_model, clip_pretrained)
    cache = _read_cache(path)
    missing = [p for p in dict.fromkeys(prompts) if p not in cache]
    if missing:
        computed = _encode_prompts(missing, clip_model, clip_pretrained, path, weights_dir)
        cache.update(computed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)
        log.info("wrote %d CLIP text embedding(s) to %s", len(computed), path)
    return [torch.tensor(cache[p], dtype=torch.float32) for p in prompts]


def _read_cache(path: Path) -> dict[str, list[float]]:
    if not path.is_file():
        return {}
    try:
        cache = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise IndicatorUnavailableError(
            f"CLIP indicator cache {path} is not valid JSON ({err}); delete it and recompute"
        ) from err
    if not isinstance(cache, dict):
        raise IndicatorUnavailableError(f"CLIP indicator cache {path} must map prompt -> vector")
    return cache


def _encode_prompts(
    prompts: Sequence[str],
    clip_model: str,
    clip_pretrained: str,
    cache_path: Path,
    weights_dir: Path | None,
) -> dict[str, list[float]]:
    import open_clip

    if clip_model not in open_clip.list_models():
        raise ValueError(f"unknown open_clip model {clip_model!r}; see open_clip.list_models()")
    pretrained: str | None = None
    quick_gelu = False
    if clip_pretrained != "none":
        pretrained, quick_gelu = _resolve_clip_checkpoint(
            clip_model, clip_pretrained, cache_path, weights_dir, prompts
        )
    model = open_clip.create_model(clip_model, pretrained=pretrained, force_quick_gelu=quick_gelu)
    model.eval()
    tokenizer = open_clip.get_tokenizer(clip_model)
    with torch.no_grad():
        embeddings = model.encode_text(tokenizer(list(prompts))).float()  # [P, D]
        embeddings = embeddings / embeddings.norm(dim=-1, keepdim=True)
    return {p: e.tolist() for p, e in zip(prompts, embeddings, strict=True)}


def _resolve_clip_checkpoint(
    clip_model: str,
    clip_pretrained: str,
    cache_path: Path,
    weights_dir: Path | None,
    prompts: Sequence[str],
) -> tuple[str, bool]:
    """Local path of the open_clip checkpoint, downloading only if the hub answers quickly."""
    import open_clip
    from open_clip.pretrained import download_pretrained, get_pretrained_cfg

    cfg = get_pretrained_cfg(clip_model, clip_pretrained)
    if not cfg:
        raise ValueError(
            f"open_clip has no pretrained tag {clip_pretrained!r} for {clip_model}; known tags: "
            f"{open_clip.list_pretrained_tags_by_model(clip_model)} (or 'none' for random init)"
        )
    quick_gelu = bool(cfg.get("quick_gelu", False))
    stem = f"{clip_model}_{clip_pretrained}"
    local_dir = weights_directory(weights_dir) / "open_clip"
    for suffix in CHECKPOINT_SUFFIXES:
        candidate = local_dir / f"{stem}{suffix}"
        if candidate.is_file():
            return str(candidate), quick_gelu
    cached = _hf_cached_checkpoint(cfg.get("hf_hub", ""))
    if cached is not None:
        return cached, quick_gelu
    expected = local_dir / f"{stem}.bin"
    fix = (
        f"Put the open_clip checkpoint for {clip_model} / {clip_pretrained} (hub id "
        f"{cfg.get('hf_hub') or cfg.get('url')}) at {expected}, or copy a precomputed cache file "
        f"{cache_path.name} into {cache_path.parent}, made on a machine with internet by "
        f"`python -m fedst.weights experiment=<your experiment> --prepare` (or "
        f"`python -m fedst.model.indicators --sites NAME:SURGERY_TYPE ...`), "
        f"or use `indicator: onehot`. Missing prompts: {list(prompts)}"
    )
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise IndicatorUnavailableError(
            f"CLIP weights not found locally and HF_HUB_OFFLINE=1. {fix}"
        )
    if not _hub_reachable():
        raise IndicatorUnavailableError(
            f"CLIP weights not found locally and hub unreachable. {fix}"
        )
    try:
        return download_pretrained(cfg), quick_gelu
    except Exception as err:  # any download failure gets the same fix message
        raise IndicatorUnavailableError(f"downloading CLIP weights failed ({err}). {fix}") from err


def _hf_cached_checkpoint(hf_hub: str) -> str | None:
    if not hf_hub:
        return None
    from huggingface_hub import try_to_load_from_cache

    repo_id, filename = os.path.split(hf_hub)
    filename = filename or "open_clip_pytorch_model.bin"
    stem, _ = os.path.splitext(filename)
    for name in (f"{stem}.safetensors", "open_clip_model.safetensors", filename):
        found = try_to_load_from_cache(repo_id=repo_id, filename=name)
        if isinstance(found, str):
            return found
    return None


def _hub_reachable() -> bool:
    from huggingface_hub import constants

    url = urllib.parse.urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=HUB_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _parse_site(text: str) -> tuple[str, str]:
    name, sep, surgery = text.partition(":")
    if not sep or not name or not surgery:
        raise argparse.ArgumentTypeError(f"site must be NAME:SURGERY_TYPE, got {text!r}")
    return name, surgery


def main(argv: Sequence[str] | None = None) -> None:
    """Precompute and cache CLIP site indicators (run where the CLIP weights are available)."""
    parser = ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--sites",
        nargs="+",
        type=_parse_site,
        required=True,
        help="sites as NAME:SURGERY_TYPE, e.g. A:nephrectomy E:lobectomy",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_CACHE_DIR,
        help="cache directory the JSON file is written to",
    )
    parser.add_argument("--clip-model", default=DEFAULT_CLIP_MODEL, help="open_clip model name")
    parser.add_argument(
        "--clip-pretrained",
        default=DEFAULT_CLIP_PRETRAINED,
        help="open_clip pretrained tag, or 'none' for random init",
    )
    parser.add_argument(
        "--weights-dir",
        type=Path,
        default=None,
        help="weights directory holding open_clip/<model>_<tag>.(safetensors|bin|pt)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    vectors = site_indicators(
        "clip",
        args.sites,
        dim=_clip_dim(args.clip_model),
        clip_model=args.clip_model,
        clip_pretrained=args.clip_pretrained,
        cache_dir=args.out,
        weights_dir=args.weights_dir,
    )
    path = clip_cache_path(args.out, args.clip_model, args.clip_pretrained)
    for name, vector in vectors.items():
        print(f"{name}: dim {vector.numel()} norm {vector.norm():.4f}")
    print(f"cache: {path}")


def _clip_dim(clip_model: str) -> int:
    import open_clip

    config = open_clip.get_model_config(clip_model)
    if config is None:
        raise IndicatorUnavailableError(
            f"--clip-model {clip_model}: open_clip has no such model; choose one of "
            f"open_clip.list_models(), e.g. {DEFAULT_CLIP_MODEL}"
        )
    return int(config["embed_dim"])


if __name__ == "__main__":
    from fedst.errors import run_entry_point

    run_entry_point(main, "python -m fedst.model.indicators")
