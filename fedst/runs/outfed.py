"""Out-of-federation evaluation (paper Sec. IV-B2, Tables III and VIII).

The out-of-federation model is the sample-count-weighted average of the models the sites return
(v_k = gamma_k^T U rho_k^T for FedST, gamma_g U rho_k for the methods that return the global
shared part; fedst/runs/returned.py, built by ``Run.outfed_model``), personalized parts included, so inference is a single
forward pass. An unseen
site is prompted with its own text (e.g. "... surgery type is lobectomy"). On a binary site
(GraSP) every predicted part class counts as instrument.

The site models are read from the run directory (``sites/<site>/state_rNNNN.pt``): in simulation
the run directory holds them; in a deployment each hospital must choose to export its rho_k for
this step, which is the only time private parameters leave a site.

A new site that the run's config never listed (external validation at another hospital) is scored
by :func:`evaluate_new_site` from a folder in the generic layout (fedst/data/generic.py), without
touching the run's config.json or final.json: ``python eval_outfed.py run=RUN site_root=FOLDER``
writes ``<run>/external/<site>.json`` and a line of ``<run>/external/results.md``.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedst.runs.layout import external_result
from fedst.config import ConfigError
from fedst.data.base import DataError
from fedst.data.clips import ClipDataset
from fedst.data.generic import GenericLayoutSource
from fedst.experiment import ExperimentConfig
from fedst.model.indicators import (
    IndicatorUnavailableError,
    clip_cache_path,
    site_indicators,
    site_prompt,
)
from fedst.runs import Run
from fedst.runs.layout import (
    EXTERNAL_DIR,
    EXTERNAL_TABLE,
)
from fedst.scoring.evaluation import EvaluationResult, evaluate_model
from fedst.scoring.formatting import format_score
from fedst.scoring.site_data import open_site_data
from fedst.storage import atomic_write_text

log = logging.getLogger(__name__)


def require_known_sites(cfg: ExperimentConfig, sites: tuple[str, ...], run_dir: Path) -> None:
    """A ConfigError naming the sites of ``sites`` that the run's data config lacks."""
    unknown = [s for s in sites if s not in cfg.data.sites]
    if unknown:
        raise ConfigError(
            f"sites={list(sites)}: {unknown} not configured in {run_dir}; known sites: "
            f"{sorted(cfg.data.sites)} (out of federation: {list(cfg.data.out_of_federation)})"
        )


def evaluate_out_of_federation(
    run: Run,
    device: torch.device,
    sites: tuple[str, ...] | None = None,
    keep_examples: int = 0,
    progress: bool = False,
) -> dict[str, EvaluationResult]:
    """Score the averaged model on each out-of-federation site's test split, given that site's
    own indicator (which the model ignores under ``indicator.unseen`` fold or mean)."""
    cfg = run.cfg
    require_known_sites(cfg, sites or (), run.dir)
    model = run.outfed_model(device)
    indicators = run.method.indicators()
    results = {}
    for site in sites or cfg.data.out_of_federation:
        data = open_site_data(cfg, site, ("test",))
        results[site] = evaluate_model(
            model,
            data.test,
            indicators.get(site),
            device,
            keep_examples=keep_examples,
            progress=progress,
            **cfg.train.evaluation_options(),
        )
        log.info(
            "out-of-federation %s: Dice %s IoU %s",
            site,
            format_score(results[site].summary["dice"]),
            format_score(results[site].summary["iou"]),
        )
    return results


# -- a new site the run never listed (external validation) ---------------------------------------

SITE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class NewSite:
    """A site folder in the generic layout that the run's config does not list."""

    name: str
    """Its name: the file name of its results and the ``{site}`` of its CLIP prompt."""
    folder: Path
    """The site folder (holds meta.json, videos/, splits/test.txt)."""
    surgery_type: str
    """Its surgery type: the ``{surgery_type}`` of its CLIP prompt (default: meta.json's)."""
    source: GenericLayoutSource


def open_new_site(
    run: Run,
    site_root: Path,
    site_name: str | None = None,
    surgery_type: str | None = None,
) -> NewSite:
    """Open and check a new site folder: the layout (meta.json, splits/test.txt and the videos it
    lists), its name (not a site of the run) and its surgery type. Raises DataError / ConfigError
    naming the file, key or value and the fix."""
    folder = Path(site_root).expanduser().resolve()
    if not folder.is_dir():
        raise DataError(
            f"site_root={site_root}: folder does not exist; pass the folder of one site in the "
            f"generic layout (it holds meta.json, videos/ and splits/test.txt)"
        )
    if not (folder / "meta.json").is_file():
        inner = sorted(p.name for p in folder.iterdir() if (p / "meta.json").is_file())
        if inner:
            raise DataError(
                f"site_root={site_root} has no meta.json but holds the site folder(s) {inner}: "
                f"pass one of them, e.g. site_root={folder / inner[0]}"
            )
    name = site_name or folder.name
    if not SITE_NAME_PATTERN.match(name):
        raise ConfigError(
            f"site_name={name!r}: use letters, digits, '_', '.' or '-' (it names the results "
            f"file {EXTERNAL_DIR}/<site_name>.json); pass site_name=..."
        )
    known = sorted({*run.cfg.data.sites, *run.method.site_order()})
    if name in known:
        raise ConfigError(
            f"site_name={name!r} is already a site of this run ({known}); a new site needs its "
            f"own name (it enters the site prompt): pass site_name=<another name>, or score the "
            f"configured site with sites=[{name}]"
        )
    source = GenericLayoutSource(folder.parent, name, site_dir=folder.name)  # checks meta.json
    if not (folder / "splits" / "test.txt").is_file():
        raise DataError(
            f"{folder / 'splits' / 'test.txt'}: the site has no test split; a new site is scored "
            f"on its test split: list the videos to score there, one video_id per line"
        )
    source.videos("test")  # checks the split file and every listed video's folders
    surgery = surgery_type or source.surgery_type
    if not isinstance(surgery, str) or not surgery.strip():
        raise ConfigError(
            f"surgery_type={surgery!r} (from {folder / 'meta.json'} unless given): pass a surgery "
            f"type, e.g. surgery_type=lobectomy"
        )
    return NewSite(name=name, folder=folder, surgery_type=surgery, source=source)


def new_site_indicator(run: Run, site: str, surgery_type: str) -> torch.Tensor | None:
    """The indicator input [dim] of the out-of-federation model at a site outside the run (None
    when the method uses none).

    Under ``indicator.unseen`` fold or mean (auto for onehot, gaussian, random) the averaged model
    reads no indicator (fedst/runs/returned.py): zeros. Under own: clip, the embedding of the
    site's own prompt (:func:`site_prompt`, paper Eq. 7 text); onehot, the next id after every
    site of the run (``Method.site_order``); random, seeded by the name; gaussian places a site by
    its position among the run's N sites, which a new site does not have: a ConfigError.
    """
    cfg = run.cfg
    rule = cfg.unseen_indicator_rule()
    if rule is None:
        return None
    if rule != "own":
        return torch.zeros(cfg.indicator.dim)
    kind = cfg.method.indicator
    order = run.method.site_order()
    if kind == "gaussian":
        raise ConfigError(
            f"{run.dir} uses method.indicator=gaussian, whose bump sits at a site's position "
            f"among the run's {len(order)} sites; a new site has none. Score it with a "
            f"run using clip, onehot or random indicators, list it in a run's "
            f"data.out_of_federation before training, or score it with unseen_indicator=fold"
        )
    ind = cfg.indicator
    try:
        vectors = site_indicators(
            kind,
            [(site, surgery_type)],
            dim=ind.dim,
            site_order=[*order, site],
            clip_model=ind.clip_model,
            clip_pretrained=ind.clip_pretrained,
            cache_dir=Path(ind.cache_dir),
            seed=cfg.seed,
        )
    except IndicatorUnavailableError as err:
        cache = clip_cache_path(Path(ind.cache_dir), ind.clip_model, ind.clip_pretrained)
        raise IndicatorUnavailableError(
            f"new site {site!r} (surgery type {surgery_type!r}): its prompt "
            f"{site_prompt(site, surgery_type)!r} has no CLIP text embedding in {cache} and CLIP "
            f"cannot be loaded here. Prepare it where the CLIP weights are: `python -m "
            f"fedst.weights --run {shlex.quote(str(run.dir))} --extra-site "
            f"{shlex.quote(f'{site}:{surgery_type}')} --prepare`, then "
            f"copy {cache.name} into {cache.parent}. Details: {err}"
        ) from err
    return vectors[site]


def evaluate_new_site(
    run: Run,
    site: NewSite,
    device: torch.device,
    progress: bool = False,
) -> tuple[EvaluationResult, dict[str, Any]]:
    """Score the out-of-federation model (``Run.outfed_model``) on a new site's test split,
    prompted as that site; returns the result and the record :func:`write_new_site_result`
    stores (what was scored, with which prompt, after which round)."""
    cfg = run.cfg
    indicator = new_site_indicator(run, site.name, site.surgery_type)
    dataset = ClipDataset(site.source, "test", cfg.clip_config(), None)
    model = run.outfed_model(device)
    result = evaluate_model(
        model,
        dataset,
        indicator,
        device,
        progress=progress,
        **cfg.train.evaluation_options(),
    )
    log.info(
        "new site %s: Dice %s IoU %s",
        site.name,
        format_score(result.summary["dice"]),
        format_score(result.summary["iou"]),
    )
    sites, _ = run.averaged_sites()
    record = {
        "site": site.name,
        "site_root": str(site.folder),
        "surgery_type": site.surgery_type,
        "indicator": cfg.method.indicator if indicator is not None else None,
        "unseen_indicator": cfg.unseen_indicator_rule(),
        "prompt": site_prompt(site.name, site.surgery_type)
        if cfg.unseen_indicator_rule() == "own" and cfg.method.indicator == "clip"
        else None,
        "binary": site.source.binary,
        "test_videos": len(dataset.videos),
        "eval_max_frames": cfg.train.eval_max_frames,
        "round": run.last_round,
        "averaged_sites": sites,
        "method": cfg.method.name,
        "seed": cfg.seed,
        "summary": result.summary,
    }
    return result, record


def write_new_site_result(
    run_dir: Path, record: dict[str, Any], round_suffix: str = ""
) -> tuple[Path, str]:
    """Write ``<run>/external/<site><round_suffix>.json`` (``round_suffix``: ``""`` for a finished
    run, ``"_rNNNN"``, the round scored, for an unfinished one, as its ``outfed_rNNNN.json``) and
    rebuild ``<run>/external/results.md`` (one line per file, with its round); returns the JSON
    path and the site's markdown line."""
    path = external_result(run_dir, record["site"], round_suffix)
    folder = path.parent
    atomic_write_text(json.dumps(record, indent=2, sort_keys=True, default=float), path)
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    header = (
        "| site | surgery type | Dice | IoU | HD95 | ASSD | frames | round | site_root |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    atomic_write_text(
        header + "".join(_markdown_line(r) + "\n" for r in records), folder / EXTERNAL_TABLE
    )
    return path, _markdown_line(record)


def _markdown_line(record: dict[str, Any]) -> str:
    s = record["summary"]
    return (
        f"| {record['site']} | {record['surgery_type']} | {format_score(s['dice'])} | "
        f"{format_score(s['iou'])} | {format_score(s['hd95'], 1)} | {format_score(s['assd'], 1)} | "
        f"{s.get('num_frames', 'n/a')} | {record['round']} | {record['site_root']} |"
    )
