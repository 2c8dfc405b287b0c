"""Out-of-federation evaluation of a finished run (paper Tables III and VIII).

    python eval_outfed.py run=runs/demo/fedst_s0_...             # site E and GraSP, tables and plots
    python eval_outfed.py run=runs/demo/fedst_s0_... sites=[E]
    python eval_outfed.py run=runs/demo/fedst_s0_... site_root=/data/new_hospital/lung site_name=lung
    python eval_outfed.py run=runs/demo/fedst_s0_... guard=dad    # corrected by DAD (fedst/guard.py)

Writes <run>/final.json (with "out_of_federation"), <run>/tables/ and <run>/plots/, and prints
the comparison table. With site_root: writes only <run>/external/<site_name>.json and
<run>/external/results.md (config.json and final.json stay as they are) and prints the site's
line. With guard=dad: the out-of-federation model corrected by GEN-Guard's DAD at the held-out
site, on ``sites`` (default: the run's out-of-federation sites); writes only
<run>/outfed_dad_<sites>.json. The model: fedst/outfed.py (fedst/guard.py with guard=dad).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from fedst import report
from fedst.cli import register_resolvers, setup_logging
from fedst.config import ConfigError
from fedst.experiment import ExperimentConfig, resolve_device
from fedst.federation.run_io import load_config
from fedst.metrics import format_score
from fedst.outfed import (
    evaluate_new_site,
    evaluate_out_of_federation,
    open_new_site,
    write_new_site_result,
)
from fedst.training import finalize_run

register_resolvers()
log = logging.getLogger("eval_outfed")


@hydra.main(config_path="configs", config_name="eval_outfed", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_dir = Path(cfg.run)
    setup_logging()
    experiment = load_config(run_dir)
    if cfg.unseen_indicator is not None:  # recorded in final.json / the new site's record
        experiment = dataclasses.replace(
            experiment,
            indicator=dataclasses.replace(experiment.indicator, unseen=str(cfg.unseen_indicator)),
        )
        experiment.unseen_indicator_rule()  # a rule the run's network cannot apply: ConfigError
    if cfg.max_frames is not None:
        experiment = dataclasses.replace(
            experiment,
            train=dataclasses.replace(experiment.train, eval_max_frames=int(cfg.max_frames)),
        )
    if cfg.guard is not None:
        if cfg.guard != "dad" or cfg.site_root is not None:
            raise ConfigError(
                f"guard={cfg.guard}: guard=dad scores configured sites (sites=[...]) with the "
                "DAD-corrected out-of-federation model; a new site (site_root) has no correction"
            )
        _evaluate_guarded(experiment, run_dir, cfg)
        return
    if cfg.site_root is not None:
        if cfg.sites is not None:
            raise ConfigError(
                f"sites={cfg.sites} and site_root={cfg.site_root}: score either configured sites "
                "or one new site per call"
            )
        site = open_new_site(
            experiment,
            Path(str(cfg.site_root)),
            None if cfg.site_name is None else str(cfg.site_name),  # site_name=2 is a name
            None if cfg.surgery_type is None else str(cfg.surgery_type),
        )
        _, record = evaluate_new_site(
            experiment, run_dir, site, resolve_device(experiment.train.device), cfg.progress
        )
        path, line = write_new_site_result(run_dir, record)
        print(line)
        print(f"written: {path} and {path.parent / 'results.md'}")
        return
    if cfg.site_name is not None or cfg.surgery_type is not None:
        raise ConfigError("site_name and surgery_type describe a new site: give site_root too")
    if cfg.sites is None:
        finalize_run(experiment, run_dir, progress=cfg.progress, qualitative=int(cfg.qualitative))
        print(report.comparison_table(report.load_runs([run_dir])).to_markdown())
        return
    sites = tuple(OmegaConf.to_container(cfg.sites))
    results = evaluate_out_of_federation(
        experiment,
        run_dir,
        resolve_device(experiment.train.device),
        sites=sites,
        progress=cfg.progress,
    )
    summary = {site: result.summary for site, result in results.items()}
    _write_summary(summary, run_dir / f"outfed_{'_'.join(sites)}.json")


def _evaluate_guarded(experiment: ExperimentConfig, run_dir: Path, cfg: DictConfig) -> None:
    """guard=dad: the DAD-corrected out-of-federation model on the chosen sites."""
    from fedst.guard import GuardError, evaluate_guarded_sites

    if cfg.sites is None:
        sites = tuple(experiment.data.out_of_federation)
    else:
        sites = tuple(OmegaConf.to_container(cfg.sites))
    try:
        summary = evaluate_guarded_sites(
            experiment, run_dir, sites, resolve_device(experiment.train.device), cfg.progress
        )
    except GuardError as err:
        raise SystemExit(f"eval_outfed.py: {err}") from err
    _write_summary(summary, run_dir / f"outfed_dad_{'_'.join(sites)}.json")


def _write_summary(summary: dict, out: Path) -> None:
    out.write_text(json.dumps(summary, indent=2, sort_keys=True, default=float))
    for site, values in summary.items():
        print(
            f"{site}: Dice {format_score(values['dice'])}  IoU {format_score(values['iou'])}  "
            f"HD95 {format_score(values['hd95'], 1)}  ASSD {format_score(values['assd'], 1)}"
        )
    print(f"written: {out}")


if __name__ == "__main__":
    main()
