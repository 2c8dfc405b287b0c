"""final.json: what a finished run scored, assembled once from its files and its returned models.

:func:`write_final` reads the run's streams (metrics.jsonl, comm.jsonl, train.jsonl,
device.jsonl, benchmark.json), scores the out-of-federation sites (:mod:`fedst.runs.outfed`)
and, where the run validated, the rounds chosen on validation (:mod:`fedst.runs.model_selection`),
and writes final.json. The tables and plots made from it are fedst/training.py's
``finalize_run`` (fedst.report sits above this package).

final.json marks a finished run (:func:`fedst.runs.files.unfinished`): only the end of training,
or eval_outfed.py on a finished run, writes it.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedst import units
from fedst.experiment import ExperimentConfig, run_device
from fedst.runs.layout import (
    BENCHMARK_JSON,
    COMM_JSONL,
    DEVICE_JSONL,
    FINAL_JSON,
    METRICS_JSONL,
    TRAIN_JSONL,
)
from fedst.runs.model_selection import run_selection
from fedst.runs.outfed import evaluate_out_of_federation
from fedst.runs.run import Run
from fedst.scoring.evaluation import evaluate_model
from fedst.scoring.metrics import SUMMARY_METRIC_NAMES
from fedst.scoring.site_data import open_site_data
from fedst.storage import atomic_write_text, read_jsonl

ROUND_KIND = "round"
"""comm.jsonl ``kind`` of a federated round's rows (the default when absent); a method's final
stage writes its own (e.g. FedDP's "uncertainty_tuning")."""

SUMMARY_KEYS = (*SUMMARY_METRIC_NAMES, "num_frames", "per_class")
"""What final.json keeps of a site's evaluation row."""


@dataclass
class FinalRecord:
    """What :func:`write_final` wrote (``final``, final.json's content), the qualitative examples
    it scored on the way (rows of fedst.report.plots.qualitative_grid) and the run's streams it
    read (metrics.jsonl, comm.jsonl, train.jsonl rows), so the plots need not read them again."""

    final: dict[str, Any]
    examples: list[tuple] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    comm: list[dict[str, Any]] = field(default_factory=list)
    train: list[dict[str, Any]] = field(default_factory=list)


def write_final(
    run: Run, progress: bool = False, qualitative: int = 2, site_data: bool = True
) -> FinalRecord:
    """Score the finished ``run`` and write its final.json.

    ``qualitative``: frames per site kept as examples (0: none). ``site_data=False``
    (deployment): the server holds no federated site's data, so examples come from the
    out-of-federation sites only. A run whose server checkpoint is not that of its last round is
    refused, as a bug of the caller.
    """
    cfg, run_dir = run.cfg, run.dir
    if run.last_round < cfg.train.rounds:
        raise RuntimeError(
            f"write_final: {run_dir} completed {run.last_round} of {cfg.train.rounds} rounds; "
            "only the end of its training writes final.json"
        )
    device = run.device
    metrics = read_jsonl(run_dir / METRICS_JSONL)
    last_round = max((r["round"] for r in metrics), default=0)
    sites = {
        r["site"]: summary_scalars(r)
        for r in metrics
        if r["round"] == last_round
        and r["model"] == "personal"
        and r.get("split", "test") == "test"
    }
    outfed = {}
    examples: list[tuple] = []
    if cfg.data.out_of_federation:
        evaluated = evaluate_out_of_federation(
            run, device, keep_examples=qualitative, progress=progress
        )
        for site, result in evaluated.items():
            outfed[site] = summary_scalars(result.summary)
            examples += example_rows(cfg, result)
    if qualitative and site_data:
        indicators = run.method.indicators()
        for site in cfg.data.federation:
            model = run.site_model(run.method.party_of(site), device)
            data = open_site_data(cfg, site, ("test",))
            result = evaluate_model(
                model,
                data.test,
                indicators.get(site),
                device,
                **{**cfg.train.evaluation_options(), "max_frames": qualitative},
                keep_examples=qualitative,
            )
            examples += example_rows(cfg, result)
    comm = read_jsonl(run_dir / COMM_JSONL)
    train = read_jsonl(run_dir / TRAIN_JSONL)
    rounds = [r for r in comm if r.get("kind", ROUND_KIND) == ROUND_KIND]
    steady = [r for r in rounds if r["round"] > 1] or rounds  # round 1 also downloads initial rho
    final = {
        "method": cfg.method.name,
        "seed": cfg.seed,
        "experiment": cfg.name,
        "rounds": min(last_round, cfg.train.rounds),  # federated rounds (not a final stage)
        "sites": sites,
        "out_of_federation": outfed,
        **_outfed_average(run),
        # which indicator the out-of-federation model gave its sites (indicator.unseen resolved)
        "unseen_indicator": cfg.unseen_indicator_rule() if outfed else None,
        # per site and round, parameter values only (fp32), as in the paper's Table IX; MB =
        # 10^6 bytes, MiB = 2^20 bytes (the unit the paper's figures appear to use, fedst/units.py)
        **_sizes_per_round("upload", rounds, "upload_param_bytes"),
        **_sizes_per_round("download", steady, "download_param_bytes"),
        **_final_stage_comm(comm),
        # the replies the server refused (fedst/federation/reply_checks.py): its train.jsonl rows
        "refused_replies": refused_replies(train),
    }
    if cfg.train.val_every is not None:  # rounds chosen on validation only, then tested
        record = run_selection(run, device, progress=progress)
        rule = cfg.selection.rule
        final["selection"] = {
            "rule": rule,
            "rounds": record["choices"][rule],
            "model_selection_failure": record["model_selection_failure"],
            "test": record["test"][rule],
        }
    final["code"] = code_version()  # which code the numbers come from
    starts = read_jsonl(run_dir / DEVICE_JSONL)  # [] for a run older than the device log
    if starts:  # which device, card and precision the numbers come from (the latest start)
        final["device"] = {k: v for k, v in starts[-1].items() if k not in ("started", "role")}
    if (run_dir / BENCHMARK_JSON).is_file():  # which procedural benchmark the numbers are on
        final["benchmark"] = json.loads((run_dir / BENCHMARK_JSON).read_text())
    atomic_write_text(json.dumps(final, indent=2, sort_keys=True), run_dir / FINAL_JSON)
    return FinalRecord(final, examples, metrics, comm, train)


def code_version() -> dict[str, Any] | None:
    """{"commit": HEAD, "dirty": uncommitted changes to tracked files} of the checkout this code
    runs from; None outside a git checkout (an installed package) or without git."""
    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}


def refused_replies(train_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """final.json ``refused_replies``: how many replies the server refused, by check and by
    site, and each one (round, site, step, check, reason) from the train.jsonl rows."""
    rows = [r for r in train_rows if "refused" in r]
    by_check: dict[str, int] = {}
    by_site: dict[str, int] = {}
    for row in rows:
        by_check[row["refused"]] = by_check.get(row["refused"], 0) + 1
        by_site[row["site"]] = by_site.get(row["site"], 0) + 1
    return {
        "count": len(rows),
        "by_check": by_check,
        "by_site": by_site,
        "replies": [
            {k: row[k] for k in ("round", "site", "step", "refused", "reason")} for row in rows
        ],
    }


def summary_scalars(row: dict[str, Any]) -> dict[str, Any]:
    """A site's evaluation row as final.json keeps it (:data:`SUMMARY_KEYS` it has)."""
    return {k: row[k] for k in SUMMARY_KEYS if k in row}


def example_rows(cfg: ExperimentConfig, result: Any) -> list[tuple]:
    """Rows of plots.qualitative_grid: (title, image, ground truth, {method: prediction}, binary)."""
    return [
        (sid, img, gt, {cfg.method.name: pred}, result.binary)
        for sid, img, gt, pred in result.examples
    ]


def _final_stage_comm(comm: list[dict[str, Any]]) -> dict[str, Any]:
    """Per site, MB (10^6 bytes, parameter values) of a final stage's one-off exchange."""
    stage = [r for r in comm if r.get("kind", ROUND_KIND) != ROUND_KIND]
    if not stage:
        return {}
    return {
        "final_stage": {
            "kind": stage[0]["kind"],
            **_sizes_per_round("upload", stage, "upload_param_bytes", "per_site"),
            **_sizes_per_round("download", stage, "download_param_bytes", "per_site"),
            **_sizes_per_round(
                "personal_download", stage, "personal_download_param_bytes", "per_site"
            ),
        }
    }


def _outfed_average(run: Run) -> dict[str, Any]:
    """Which sites the out-of-federation model averages (written only when one is left out)."""
    if not run.cfg.data.out_of_federation:
        return {}
    sites, left_out = run.averaged_sites()
    return {"out_of_federation_average": {"sites": sites, "left_out": left_out}} if left_out else {}


def _sizes_per_round(
    name: str, rows: list[dict[str, Any]], key: str, per: str = "per_round"
) -> dict[str, float]:
    """``{<name>_mb_<per>, <name>_mib_<per>}``: the mean of ``key`` (bytes) over rows."""
    mean_bytes = sum(r[key] for r in rows) / len(rows) if rows else 0.0
    return {
        f"{name}_mb_{per}": units.megabytes(mean_bytes),
        f"{name}_mib_{per}": units.mebibytes(mean_bytes),
    }
