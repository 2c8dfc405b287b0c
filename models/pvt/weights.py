"""Where PVTv2 ImageNet weights come from, and reading checkpoint files.

Search order of :func:`resolve_pretrained` for ``pretrained=True``:

1. the weights directory (argument ``weights_dir``, else env ``FEDST_WEIGHTS_DIR``, else
   ``<repo root>/weights``): ``<variant>.pth`` (the official release file name, e.g.
   ``pvt_v2_b0.pth``), ``<variant>.pt``, ``<variant>.bin``, ``<variant>.safetensors``, or
   ``<variant>.in1k/model.safetensors`` (``huggingface-cli download --local-dir`` of timm's repo);
2. the local Hugging Face cache (``timm/<variant>.in1k``, file ``model.safetensors``);
3. ONE quick probe of the Hugging Face hub (no retry loop; skipped when ``HF_HUB_OFFLINE`` is set),
   and the download only if the probe answered.

When nothing works, :class:`WeightsNotFoundError` says which file to put where and where to get it.
Key names inside the files are handled by ``models.pvt.pvt_v2.load_pretrained``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from timm.models import get_pretrained_cfg

__all__ = [
    "HUB_FILENAME",
    "WEIGHTS_DIR_ENV",
    "WeightsNotFoundError",
    "describe_weights",
    "find_in_hf_cache",
    "hub_repo_id",
    "local_candidates",
    "read_state_dict",
    "resolve_pretrained",
    "weights_directory",
]

_logger = logging.getLogger(__name__)

WEIGHTS_DIR_ENV = "FEDST_WEIGHTS_DIR"
DEFAULT_WEIGHTS_DIR = Path(__file__).resolve().parents[2] / "weights"
HUB_FILENAME = "model.safetensors"
HUB_PROBE_TIMEOUT_S = 5.0
OFFICIAL_RELEASE_URL = "https://github.com/whai362/PVT/releases/download/v2/{variant}.pth"
TORCH_SUFFIXES = (".pth", ".pt", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"
_TRUE_STRINGS = {"1", "on", "yes", "true"}


class WeightsNotFoundError(FileNotFoundError):
    """No pretrained PVTv2 weights could be found locally or fetched from the hub."""


def weights_directory(weights_dir: str | Path | None = None) -> Path:
    """The directory searched for weight files: argument, else $FEDST_WEIGHTS_DIR, else weights/."""
    if weights_dir is not None:
        return Path(weights_dir).expanduser()
    from_env = os.environ.get(WEIGHTS_DIR_ENV)
    return Path(from_env).expanduser() if from_env else DEFAULT_WEIGHTS_DIR


def local_candidates(variant: str, weights_dir: str | Path | None = None) -> list[Path]:
    """File names accepted for ``variant`` in the weights directory, in search order."""
    directory = weights_directory(weights_dir)
    names = [f"{variant}{suffix}" for suffix in (*TORCH_SUFFIXES, SAFETENSORS_SUFFIX)]
    return [directory / name for name in names] + [directory / f"{variant}.in1k" / HUB_FILENAME]


def hub_repo_id(variant: str) -> str:
    """The Hugging Face repo of timm's ImageNet-1k weights, e.g. ``timm/pvt_v2_b0.in1k``."""
    cfg = get_pretrained_cfg(f"{variant}.in1k")
    if cfg is None or not cfg.hf_hub_id:
        raise ValueError(f"timm has no hub weights for PVTv2 variant '{variant}'")
    return cfg.hf_hub_id


def find_in_hf_cache(variant: str) -> Path | None:
    """Path of timm's ``model.safetensors`` for ``variant`` in the local HF cache, if present."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id=hub_repo_id(variant), filename=HUB_FILENAME)
    return Path(cached) if isinstance(cached, str) else None


def _hub_offline() -> bool:
    from huggingface_hub import constants

    from_env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or from_env.strip().lower() in _TRUE_STRINGS


def _download_from_hub(variant: str) -> tuple[Path | None, str]:
    """One metadata probe with a short timeout, then the download: (path or None, reason).

    ``hf_hub_download`` alone retries a failed metadata call for up to a minute when nothing is
    cached, so the probe (no retries) decides first whether the hub is reachable.
    """
    if _hub_offline():
        return None, "HF_HUB_OFFLINE is set, hub not tried"
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url

    repo_id = hub_repo_id(variant)
    endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")
    url = hf_hub_url(repo_id, HUB_FILENAME, endpoint=endpoint)
    try:
        get_hf_file_metadata(url, timeout=HUB_PROBE_TIMEOUT_S, endpoint=endpoint)
    except Exception as err:  # any network or HTTP failure means: not available from the hub
        return None, f"hub probe of {url} failed ({type(err).__name__}: {err})"
    _logger.info("downloading %s/%s from %s", repo_id, HUB_FILENAME, endpoint)
    path = hf_hub_download(repo_id, HUB_FILENAME, endpoint=endpoint)
    return Path(path), f"downloaded from {endpoint}"


def _not_found_message(variant: str, weights_dir: str | Path | None, hub_reason: str) -> str:
    directory = weights_directory(weights_dir)
    names = ", ".join(path.name for path in local_candidates(variant, weights_dir)[:4])
    return (
        f"No pretrained weights for '{variant}'. Looked in {directory} for {names} "
        f"(or {variant}.in1k/{HUB_FILENAME}), in the Hugging Face cache for "
        f"{hub_repo_id(variant)}/{HUB_FILENAME}; {hub_reason}. "
        f"Fix: put {variant}.pth (official release: "
        f"{OFFICIAL_RELEASE_URL.format(variant=variant)}) "
        f"or {variant}.safetensors (the {HUB_FILENAME} of hub repo {hub_repo_id(variant)}, "
        f"https://huggingface.co/{hub_repo_id(variant)}) into {directory} "
        f"(or set ${WEIGHTS_DIR_ENV}), or pass a file path as pretrained. "
        f"For quick experiments set pretrained: false to start from random initialisation."
    )


def resolve_pretrained(
    variant: str, pretrained: bool | str | Path, weights_dir: str | Path | None = None
) -> Path:
    """The checkpoint file to load for ``variant``; see the module docstring for the order.

    ``pretrained`` is True (search) or a file path. False means random init and has nothing to
    resolve, so it is an error here.
    """
    if pretrained is False:
        raise ValueError(
            f"resolve_pretrained('{variant}', pretrained=False): random init needs no weights file"
        )
    if pretrained is not True:
        path = Path(pretrained).expanduser()
        if not path.is_file():
            raise WeightsNotFoundError(
                f"pretrained weights file {path} for '{variant}' does not exist; give an existing "
                f".pth/.pt/.bin/.safetensors file, pretrained: true to search "
                f"{weights_directory(weights_dir)}, or pretrained: false for random init"
            )
        return path
    for path in local_candidates(variant, weights_dir):
        if path.is_file():
            _logger.info("%s weights: %s (weights directory)", variant, path)
            return path
    cached = find_in_hf_cache(variant)
    if cached is not None:
        _logger.info("%s weights: %s (Hugging Face cache)", variant, cached)
        return cached
    downloaded, reason = _download_from_hub(variant)
    if downloaded is not None:
        return downloaded
    raise WeightsNotFoundError(_not_found_message(variant, weights_dir, reason))


def describe_weights(variant: str, weights_dir: str | Path | None = None) -> str:
    """One line saying where weights for ``variant`` were found locally (no network access)."""
    for path in local_candidates(variant, weights_dir):
        if path.is_file():
            return f"{variant}: {path} (weights directory)"
    cached = find_in_hf_cache(variant)
    if cached is not None:
        return f"{variant}: {cached} (Hugging Face cache, {hub_repo_id(variant)})"
    hub = "hub download disabled (HF_HUB_OFFLINE)" if _hub_offline() else "would try hub download"
    return (
        f"{variant}: NOT FOUND in {weights_directory(weights_dir)} (expected {variant}.pth or "
        f"{variant}.safetensors) nor in the HF cache ({hub_repo_id(variant)}); {hub}"
    )


def read_state_dict(path: str | Path) -> dict[str, Any]:
    """Contents of a .pth/.pt/.bin (``torch.load(weights_only=True)``) or .safetensors file.

    Torch files may wrap the tensors (e.g. ``{"model": ...}``); unwrapping is the loader's job.
    """
    path = Path(path)
    if path.suffix == SAFETENSORS_SUFFIX:
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    if path.suffix in TORCH_SUFFIXES:
        return torch.load(path, map_location="cpu", weights_only=True)
    raise ValueError(
        f"cannot read weights file {path}: suffix '{path.suffix}' is not one of "
        f"{(*TORCH_SUFFIXES, SAFETENSORS_SUFFIX)}; convert it to .pth or .safetensors"
    )
