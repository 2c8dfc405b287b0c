"""Test scores before and after the correction, once the corrections exist."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedst.guard.correction import GuardError
from fedst.guard.fitting import held_out_site, load_guarded_model
from fedst.runs import Run
from fedst.runs.layout import GUARD_DIR, GUARD_FILE, GUARD_SCORES
from fedst.storage import atomic_write_text, load_checkpoint

log = logging.getLogger("fedst.guard")

# -- test scores before and after (only once the corrections exist) --------------------------------


def saved_corrections(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Site -> its dad.pt record without the generator weights (empty: DAD never ran)."""
    records = {}
    for path in sorted((run_dir / "sites").glob(f"*/{GUARD_DIR}/{GUARD_FILE}")):
        record = load_checkpoint(path)
        records[path.parent.parent.name] = {k: v for k, v in record.items() if k != "generator"}
    return records


def guard_test_scores(
    run: Run, device: torch.device, progress: bool = False
) -> dict[str, Any] | None:
    """Test Dice before (student) and after DAD of every corrected model, or None when the run
    has no correction. Read from ``selection/guard.json`` when it scored the same corrections,
    else measured now (only after DAD has finished: it reads the saved files) and written there.

    ``{"corrections": site -> id, "rounds": {"student", "teacher"}, "in_federation" |
    "held_out" | "out_of_federation": site -> {"before", "after"} (dice, iou, num_frames)}``.
    """
    cfg, run_dir = run.cfg, run.dir
    corrections = saved_corrections(run_dir)
    if not corrections:
        return None
    ids = {site: record["id"] for site, record in corrections.items()}
    path = run_dir / GUARD_SCORES
    if path.exists():
        cached = json.loads(path.read_text())
        if cached.get("corrections") == ids:
            return cached
    held_out = cfg.selection.held_out_site
    groups: dict[str, list[tuple[str, str]]] = {  # group -> (scored site, correcting site)
        "in_federation": [(s, s) for s in cfg.data.federation if s in corrections],
        "held_out": [(held_out, held_out)] if held_out in corrections else [],
        "out_of_federation": [
            (s, held_out) for s in cfg.data.out_of_federation if held_out in corrections
        ],
    }

    def score(model: nn.Module, site: str) -> dict[str, Any]:
        summary = _test_summary(run, model, site, device, progress, distances=False)
        return {k: summary[k] for k in ("dice", "iou", "num_frames")}

    plan = next(iter(corrections.values()))["plan"]  # every site's plan has the same rounds
    scores: dict[str, Any] = {
        "corrections": ids,
        "rounds": {"student": plan["student_round"], "teacher": plan["teacher_round"]},
    }
    for group, pairs in groups.items():
        scores[group] = {}
        for site, owner in pairs:
            guarded = load_guarded_model(run, owner, device)
            scores[group][site] = {
                "before": score(guarded.student, site),
                "after": score(guarded, site),
            }
    atomic_write_text(json.dumps(scores, indent=1, sort_keys=True), path)
    return scores


def evaluate_guarded_sites(
    run: Run,
    sites: Sequence[str],
    device: torch.device,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """The held-out site's corrected out-of-federation model on each site's test split
    (``eval_outfed.py guard=dad``); site -> evaluation summary."""
    cfg, run_dir = run.cfg, run.dir
    unknown = [s for s in sites if s not in cfg.data.sites]
    if unknown:
        raise GuardError(
            f"sites {unknown} are not configured in {run_dir}: {sorted(cfg.data.sites)}"
        )
    model = load_guarded_model(run, held_out_site(cfg), device)
    return {site: _test_summary(run, model, site, device, progress) for site in sites}


def _test_summary(
    run: Run,
    model: nn.Module,
    site: str,
    device: torch.device,
    progress: bool,
    **options: Any,
) -> dict[str, Any]:
    """evaluate_model's summary of ``model`` on ``site``'s test split, prompted as that site
    (``options`` override the run's evaluation options)."""
    from fedst.scoring.evaluation import evaluate_model
    from fedst.scoring.site_data import open_site_data

    return evaluate_model(
        model,
        open_site_data(run.cfg, site, ("test",)).test,
        run.method.indicators().get(site),
        device,
        progress=progress,
        **{**run.cfg.train.evaluation_options(), **options},
    ).summary
