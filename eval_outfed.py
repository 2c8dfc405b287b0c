"""Out-of-federation evaluation of a finished run (paper Tables III and VIII).

    python eval_outfed.py run=runs/demo/fedst_s0_...             # site E and GraSP, tables and plots
    python eval_outfed.py run=runs/demo/fedst_s0_... sites=[E]
    python eval_outfed.py run=runs/demo/fedst_s0_... site_root=/data/new_hospital/lung site_name=lung
    python eval_outfed.py run=runs/demo/fedst_s0_... guard=dad    # corrected by DAD (fedst/guard/)
    python eval_outfed.py run=runs/paper/fedst_s0_... train.device=cpu  # a GPU-sized run, on the CPU

Writes <run>/final.json (with "out_of_federation"), <run>/tables/ and <run>/plots/, and prints
the comparison table. A run whose training has not finished (interrupted; fedst/runs/files.py
``unfinished``) keeps no final.json, which only the end of its training writes: its model after
its last completed round N is scored into <run>/outfed_rNNNN.json (sites=[...]:
outfed_<sites>_rNNNN.json), and the run stays resumable (train_fed.py resume=<run>). With
site_root: writes only <run>/external/<site_name>.json (an unfinished run:
<run>/external/<site_name>_rNNNN.json) and <run>/external/results.md (config.json and
final.json stay as they are) and prints the site's line. With guard=dad: the
out-of-federation model corrected by GEN-Guard's DAD at the held-out site, on ``sites``
(default: the run's out-of-federation sites); writes only <run>/outfed_dad_<sites>.json. The
model: ``Run.outfed_model`` (fedst/runs/run.py; fedst/guard/ with guard=dad).

It writes nothing else: no Hydra folder or log file (configs/eval_outfed.yaml), and nothing at
all when ``run`` is not a run directory. A mistake ends in one line and exit status 2
(FEDST_DEBUG=1: with its traceback).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf

from fedst.cli import (
    existing_run,
    hydra_job,
    register_resolvers,
    run_hydra_entry_point,
    setup_logging,
    unknown_key_error,
)
from fedst.config import ConfigError, build
from fedst.experiment import UNSEEN_INDICATOR_RULES, with_device
from fedst.runs.files import load_config, unfinished
from fedst.runs.layout import EXTERNAL_TABLE, outfed_result
from fedst.schema.accel import check_device_name

if TYPE_CHECKING:
    from fedst.runs import Run

register_resolvers()
log = logging.getLogger("eval_outfed")


@dataclass(frozen=True)
class DeviceOverride:
    """``train.device=`` of eval_outfed.py: the device to score the run on (None: the run's own
    ``train.device``), resolved with the run's ``train.require_gpu`` as training resolves it
    (fedst.experiment.with_device, run_device)."""

    device: str | None = None

    def __post_init__(self) -> None:
        if self.device is not None:  # before the run is read
            check_device_name("train.device", self.device)


@dataclass(frozen=True)
class EvalOptions:
    """The options of eval_outfed.py, typed once; their defaults and meaning are in
    configs/eval_outfed.yaml (a key it lacks, ``+max_frame=5``, is refused here)."""

    run: str
    sites: tuple[str, ...] | None
    site_root: str | None
    site_name: str | None
    surgery_type: str | None
    max_frames: int | None
    unseen_indicator: str | None
    qualitative: int
    progress: bool
    guard: str | None
    train: DeviceOverride


KEYS_LISTED = "every key: python eval_outfed.py --help"
TEXT_KEYS = ("run", "site_root", "site_name", "surgery_type")


def eval_options(cfg: DictConfig) -> EvalOptions:
    """The command line's options, checked before anything is read or written: ``run`` given,
    every key known, every value of its type, ``unseen_indicator`` a rule."""
    if OmegaConf.is_missing(cfg, "run"):
        raise ConfigError(
            "run=RUN_DIR is missing: python eval_outfed.py run=<a run directory train_fed.py "
            "wrote, runs/<experiment>/<method>_s<seed>_<time>>"
        )
    values = OmegaConf.to_container(cfg, resolve=True)
    known = [item.name for item in dataclasses.fields(EvalOptions)]
    unknown = [key for key in values if key not in known]  # appended: +max_frame=5
    if unknown:
        raise unknown_key_error(str(unknown[0]), known, KEYS_LISTED)
    for key in TEXT_KEYS:  # a folder or a name, even when it reads as a number (site_name=2)
        if values[key] is not None:
            values[key] = str(values[key])
    options = build(EvalOptions, values)
    rule = options.unseen_indicator
    if rule is not None and rule not in UNSEEN_INDICATOR_RULES:
        raise ConfigError(
            f"unseen_indicator={rule}: choose one of {', '.join(UNSEEN_INDICATOR_RULES)} (or null: "
            "the run's indicator.unseen)"
        )
    return options


@hydra.main(config_path="configs", config_name="eval_outfed", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with hydra_job():  # a failure is raised by run_hydra_entry_point, in one line
        evaluate(cfg)


def evaluate(cfg: DictConfig) -> None:
    """Score the run's out-of-federation model as the options say (the module docstring)."""
    options = eval_options(cfg)
    run_dir = existing_run(options.run, "run")
    # the evaluation's modules, imported once the command line is right (a mistake ends sooner)
    from fedst.report import results, tables
    from fedst.runs import Run
    from fedst.runs.outfed import (
        evaluate_new_site,
        evaluate_out_of_federation,
        open_new_site,
        require_known_sites,
        write_new_site_result,
    )
    from fedst.training import finalize_run

    setup_logging()
    experiment = with_device(load_config(run_dir), options.train.device)
    if options.sites is not None:  # before any model is read
        require_known_sites(experiment, options.sites, run_dir)
    if options.unseen_indicator is not None:  # recorded in final.json / the new site's record
        experiment = dataclasses.replace(
            experiment,
            indicator=dataclasses.replace(experiment.indicator, unseen=options.unseen_indicator),
        )
        experiment.unseen_indicator_rule()  # a rule the run's network cannot apply: ConfigError
    if options.max_frames is not None:
        experiment = dataclasses.replace(
            experiment,
            train=dataclasses.replace(experiment.train, eval_max_frames=options.max_frames),
        )
    if options.guard is not None:
        if options.guard != "dad" or options.site_root is not None:
            raise ConfigError(
                f"guard={options.guard}: guard=dad scores configured sites (sites=[...]) with the "
                "DAD-corrected out-of-federation model; a new site (site_root) has no correction"
            )
        run = Run(run_dir, experiment)
        _evaluate_guarded(run, options, _round_suffix(run))
        return
    if options.site_root is not None:
        if options.sites is not None:
            raise ConfigError(
                f"sites={list(options.sites)} and site_root={options.site_root}: score either "
                "configured sites or one new site per call"
            )
        run = Run(run_dir, experiment)
        suffix = _round_suffix(run)
        site = open_new_site(run, Path(options.site_root), options.site_name, options.surgery_type)
        _, record = evaluate_new_site(run, site, run.device, options.progress)
        path, line = write_new_site_result(run_dir, record, suffix)
        print(line)
        print(f"written: {path} and {path.parent / EXTERNAL_TABLE}")
        if suffix:
            print(unfinished_note(run_dir, suffix))
        return
    if options.site_name is not None or options.surgery_type is not None:
        raise ConfigError("site_name and surgery_type describe a new site: give site_root too")
    run = Run(run_dir, experiment)
    suffix = _round_suffix(run)
    if options.sites is None and not suffix:
        finalize_run(run, progress=options.progress, qualitative=options.qualitative)
        print(tables.comparison_table(results.load_runs([run_dir])).to_markdown())
        return
    sites = options.sites or tuple(experiment.data.out_of_federation)
    if not sites:
        raise ConfigError(
            f"run={run_dir}: its training has not finished and it has no out-of-federation "
            f"site to score; name one (sites=[...]) or finish it: python train_fed.py "
            f"resume={run_dir}"
        )
    scored = evaluate_out_of_federation(run, run.device, sites=sites, progress=options.progress)
    summary = {site: result.summary for site, result in scored.items()}
    name = "" if options.sites is None else "_" + "_".join(options.sites)
    _write_summary(summary, outfed_result(run_dir, name, suffix), run_dir, suffix)


def _round_suffix(run: Run) -> str:
    """``""`` for a finished run; ``"_rNNNN"`` (its last completed round) for an unfinished one,
    whose scores never go into final.json (fedst/runs/files.py ``unfinished``). A run without a
    completed round has no model to score: a ConfigError naming the fix."""
    if unfinished(run.dir) is None:
        return ""
    try:
        completed = run.last_round
    except FileNotFoundError as err:
        raise ConfigError(
            f"run={run.dir}: no round of its training has completed, so it has no model to "
            f"score; continue it: python train_fed.py resume={run.dir}"
        ) from err
    return f"_r{completed:04d}"


def _evaluate_guarded(run: Run, options: EvalOptions, suffix: str) -> None:
    """guard=dad: the DAD-corrected out-of-federation model on the chosen sites."""
    from fedst.guard import evaluate_guarded_sites

    sites = tuple(run.cfg.data.out_of_federation) if options.sites is None else options.sites
    summary = evaluate_guarded_sites(run, sites, run.device, options.progress)
    _write_summary(
        summary, outfed_result(run.dir, f"_dad_{'_'.join(sites)}", suffix), run.dir, suffix
    )


def _write_summary(summary: dict, out: Path, run_dir: Path, suffix: str) -> None:
    """The scores per site into ``out``, and their lines; for an unfinished run (``suffix``),
    which round they score and how to finish it."""
    from fedst.scoring.formatting import format_score

    out.write_text(json.dumps(summary, indent=2, sort_keys=True, default=float))
    for site, values in summary.items():
        print(
            f"{site}: Dice {format_score(values['dice'])}  IoU {format_score(values['iou'])}  "
            f"HD95 {format_score(values['hd95'], 1)}  ASSD {format_score(values['assd'], 1)}  "
            f"challenge IoU {format_score(values['challenge_iou'])}  "
            f"ISI IoU {format_score(values['isi_iou'])}  mcIoU {format_score(values['mciou'])}"
        )
    print(f"written: {out}")
    if suffix:
        print(unfinished_note(run_dir, suffix))


def unfinished_note(run_dir: Path, suffix: str) -> str:
    """The line that says an unfinished run's scores (``suffix``: ``_rNNNN``) are of round N."""
    return (
        f"{run_dir}: its training has not finished; these are the scores of round "
        f"{int(suffix[2:])}, kept out of final.json (resume it: python train_fed.py "
        f"resume={run_dir})"
    )


if __name__ == "__main__":
    run_hydra_entry_point(main, "eval_outfed.py", "eval_outfed", KEYS_LISTED, groups=False)
