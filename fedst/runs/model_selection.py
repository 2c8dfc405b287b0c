"""Model selection without a test split: which round's model a run reports, by ``selection.rule``.

The rules are pure functions over metrics.jsonl rows of split ``"val"`` (they are handed nothing
else, so no test score can enter a choice):

* ``last``: the run's last round (what the paper's tables use).
* ``val``: per site, the round whose personalized model v_k scored best on that site's own
  validation split.
* ``mixed``: one round for every site, the best *pooled* validation score of the training sites:
  sum_k n_k m_k / sum_k n_k over the sites' validation frames n_k (= the per-frame mean over the
  union of their validation sets). GEN-Guard's conventional selection, Eq. 6 (V_mix).
* ``cbe``: client-blocked evaluation, GEN-Guard Eq. 7: a site held out of training entirely
  (``selection.held_out_site``) scores the out-of-federation model (gamma_g U the n_k-weighted
  average of the training sites' rho_k, fedst/runs/outfed.py) of every validation round on its
  validation split; the best round is chosen (for every model of the run).

A model-selection failure (MSF) is ``mixed`` and ``cbe`` choosing different rounds.

Conventions: the metric is ``selection.metric`` (dice or iou, higher is better); a round whose
value is missing (null: nothing scorable) is not a candidate; a ``mixed`` candidate round needs a
validation row of every training site; ties go to the earliest round. The held-out site's scores
are computed after training from the kept snapshots (fedst/federation/snapshots.py), as GEN-Guard's
post-hoc selection over the checkpoint trajectory, and written to ``selection/held_out_val.jsonl``.

Only after the rounds are chosen are the chosen models evaluated on test
(:func:`evaluate_choices`); :func:`run_selection` does both and writes
``selection/selection.json``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fedst.config import ConfigError
from fedst.errors import UserError
from fedst.runs import Run
from fedst.runs.layout import HELD_OUT_ROWS, METRICS_JSONL, SELECTION_DIR, SELECTION_FILE
from fedst.scoring.evaluation import evaluate_model
from fedst.scoring.site_data import open_site_data
from fedst.storage import atomic_write_text, read_jsonl

log = logging.getLogger(__name__)

OUTFED_MODEL = "outfed"
"""``model`` of a metrics row scoring the out-of-federation model."""


class SelectionError(UserError, ValueError):
    """No round can be chosen (no validation rows, or a rule's inputs are missing)."""


# -- the rules: pure functions over validation rows ------------------------------------------------


def _validation(rows: Iterable[Mapping[str, Any]], model: str = "personal") -> list[Mapping]:
    return [r for r in rows if r.get("split") == "val" and r.get("model", "personal") == model]


def _best(scores: Mapping[int, float], what: str) -> int:
    """The round of the highest score; ties go to the earliest round."""
    if not scores:
        raise SelectionError(f"{what}: no validation round with a score to choose from")
    best = max(scores.values())
    return min(r for r, v in scores.items() if v == best)


def select_last(rows: Iterable[Mapping[str, Any]]) -> int:
    """The last round that has validation rows (the run's last round: it is always scored)."""
    rounds = [r["round"] for r in _validation(rows)]
    if not rounds:
        raise SelectionError("rule last: no validation rows")
    return max(rounds)


def select_val(rows: Iterable[Mapping[str, Any]], metric: str = "dice") -> dict[str, int]:
    """Per site: the round of its best validation score."""
    by_site: dict[str, dict[int, float]] = {}
    for row in _validation(rows):
        by_site.setdefault(row["site"], {})
        if row.get(metric) is not None:
            by_site[row["site"]][row["round"]] = float(row[metric])
    return {site: _best(scores, f"rule val, site {site}") for site, scores in by_site.items()}


def pooled_scores(
    rows: Iterable[Mapping[str, Any]], sites: Iterable[str], metric: str = "dice"
) -> dict[int, float]:
    """Per round: sum_k n_k m_k / sum_k n_k over ``sites`` (n_k: validation frames of site k);
    only rounds where every site has a scored validation row."""
    sites = list(sites)
    table: dict[int, dict[str, Mapping]] = {}
    for row in _validation(rows):
        if row["site"] in sites:
            table.setdefault(row["round"], {})[row["site"]] = row
    pooled = {}
    for server_round, by_site in table.items():
        if set(by_site) != set(sites) or any(r.get(metric) is None for r in by_site.values()):
            continue
        frames = sum(int(r["num_frames"]) for r in by_site.values())
        pooled[server_round] = (
            sum(int(r["num_frames"]) * float(r[metric]) for r in by_site.values()) / frames
        )
    return pooled


def select_mixed(
    rows: Iterable[Mapping[str, Any]], sites: Iterable[str], metric: str = "dice"
) -> int:
    """The round of the best pooled validation score of ``sites`` (GEN-Guard Eq. 6)."""
    return _best(pooled_scores(rows, sites, metric), "rule mixed")


def select_cbe(rows: Iterable[Mapping[str, Any]], held_out: str, metric: str = "dice") -> int:
    """The round of the out-of-federation model's best score on the held-out site's validation
    split (GEN-Guard Eq. 7)."""
    scores = {
        r["round"]: float(r[metric])
        for r in _validation(rows, OUTFED_MODEL)
        if r["site"] == held_out and r.get(metric) is not None
    }
    return _best(scores, f"rule cbe, held-out site {held_out}")


@dataclass(frozen=True)
class Choice:
    """The rounds a rule chooses: each training site's personalized model, and the
    out-of-federation model (None: the rule does not choose one round for it)."""

    rule: str
    sites: dict[str, int]
    outfed: int | None


def choose(
    rows: Iterable[Mapping[str, Any]],
    sites: Iterable[str],
    held_out: str | None = None,
    metric: str = "dice",
) -> dict[str, Choice]:
    """Every rule's choice that the rows allow (cbe only with a held-out site). ``rows`` are
    filtered to validation rows first."""
    rows = [r for r in rows if r.get("split") == "val"]
    sites = list(sites)
    last = select_last(rows)
    per_site = select_val(rows, metric)
    missing = [s for s in sites if s not in per_site]
    if missing:
        raise SelectionError(f"rule val: no validation rows of site(s) {missing}")
    mixed = select_mixed(rows, sites, metric)
    choices = {
        "last": Choice("last", dict.fromkeys(sites, last), last),
        "val": Choice("val", {s: per_site[s] for s in sites}, None),
        "mixed": Choice("mixed", dict.fromkeys(sites, mixed), mixed),
    }
    if held_out is not None:
        cbe = select_cbe(rows, held_out, metric)
        choices["cbe"] = Choice("cbe", dict.fromkeys(sites, cbe), cbe)
    return choices


def model_selection_failure(choices: Mapping[str, Choice]) -> bool | None:
    """GEN-Guard's MSF: conventional (Eq. 6) and client-blocked (Eq. 7) rounds differ (None
    without a held-out site)."""
    if "cbe" not in choices:
        return None
    return choices["mixed"].outfed != choices["cbe"].outfed


# -- reading and scoring a run (selection never opens a test split) ---------------------------


def held_out_validation(
    run: Run, device: torch.device, progress: bool = False
) -> list[dict[str, Any]]:
    """Score the out-of-federation model of every kept validation round on the held-out site's
    validation split; rows in metrics.jsonl's layout (split "val", model "outfed"), also written
    to ``selection/held_out_val.jsonl``."""
    from fedst.data.splits import validation_dataset

    cfg = run.cfg
    held_out = cfg.selection.held_out_site
    if held_out is None:
        return []
    dataset = validation_dataset(cfg.data.open(held_out), cfg.data.val_split, cfg.clip_config())
    indicator = run.method.indicators().get(held_out)
    rows = []
    for server_round in run.snapshot_rounds():
        model = run.outfed_model(device, round=server_round)
        result = evaluate_model(
            model,
            dataset,
            indicator,
            device,
            progress=progress,
            **cfg.train.evaluation_options(),
        )
        rows.append(
            {
                "round": server_round,
                "site": held_out,
                "split": "val",
                "model": OUTFED_MODEL,
                **result.summary,
            }
        )
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    atomic_write_text(text, run.path(HELD_OUT_ROWS))
    return rows


def validation_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's validation rows: metrics.jsonl's split "val" and the held-out site's rows."""
    rows = [r for r in read_jsonl(run_dir / METRICS_JSONL) if r.get("split") == "val"]
    if (run_dir / HELD_OUT_ROWS).exists():
        rows += read_jsonl(run_dir / HELD_OUT_ROWS)
    return rows


def select_rounds(run: Run, device: torch.device, progress: bool = False) -> dict[str, Choice]:
    """The selection phase: validation scores only (the held-out site's computed here)."""
    cfg = run.cfg
    if cfg.train.val_every is None:
        raise ConfigError(
            f"{run.dir}: the run scored no validation round (train.val_every=null); rerun with "
            f"train.val_every=<k> to select a round"
        )
    held_out_validation(run, device, progress)
    return choose(
        validation_rows(run.dir),
        cfg.data.federation,
        cfg.selection.held_out_site,
        cfg.selection.metric,
    )


def evaluate_choices(
    run: Run,
    choices: Mapping[str, Choice],
    device: torch.device,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """After selection: each choice's test scores, in federation (each site's v_k at its chosen
    round on its test split) and out of federation (the averaged model at the chosen round on
    every data.out_of_federation site). A (model, round) scored once is reused by other rules."""
    cfg = run.cfg
    indicators = run.method.indicators()
    tests = {s: open_site_data(cfg, s, ("test",)).test for s in cfg.data.federation}
    tests.update({s: open_site_data(cfg, s, ("test",)).test for s in cfg.data.out_of_federation})
    cache: dict[tuple[str, str, int], dict[str, Any]] = {}

    def score(model_name: str, site: str, server_round: int) -> dict[str, Any]:
        key = (model_name, site, server_round)
        if key not in cache:
            if model_name == OUTFED_MODEL:
                model = run.outfed_model(device, round=server_round)
            else:
                model = run.site_model(site, device, round=server_round)
            summary = evaluate_model(
                model,
                tests[site],
                indicators.get(site),
                device,
                progress=progress,
                **cfg.train.evaluation_options(),
            ).summary
            cache[key] = {k: summary[k] for k in ("dice", "iou", "hd95", "assd", "num_frames")}
        return cache[key]

    results = {}
    for rule, choice in choices.items():
        in_fed = {s: {"round": r, **score("personal", s, r)} for s, r in choice.sites.items()}
        out_fed = {}
        if choice.outfed is not None:
            out_fed = {
                s: {"round": choice.outfed, **score(OUTFED_MODEL, s, choice.outfed)}
                for s in cfg.data.out_of_federation
            }
        results[rule] = {"in_federation": in_fed, "out_of_federation": out_fed}
    return results


def run_selection(run: Run, device: torch.device, progress: bool = False) -> dict[str, Any]:
    """Choose rounds by every rule (validation only), then score the choices on test; write
    ``selection/selection.json`` and return it."""
    cfg = run.cfg
    choices = select_rounds(run, device, progress)
    msf = model_selection_failure(choices)
    record = {
        "rule": cfg.selection.rule,
        "metric": cfg.selection.metric,
        "held_out_site": cfg.selection.held_out_site,
        "choices": {rule: asdict(choice) for rule, choice in choices.items()},
        "model_selection_failure": msf,
        "test": evaluate_choices(run, choices, device, progress),
    }
    atomic_write_text(json.dumps(record, indent=1, sort_keys=True), run.path(SELECTION_FILE))
    log.info(
        "selection (%s): %s; MSF %s",
        cfg.selection.metric,
        ", ".join(
            f"{r}: {c.outfed if c.outfed is not None else c.sites}" for r, c in choices.items()
        ),
        msf,
    )
    return record
