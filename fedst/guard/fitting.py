"""Which corrections a run has, their models, and fitting DAD at one site on its validation split
only (see the package docstring)."""

from __future__ import annotations

import copy
import logging
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset

from fedst.data.base import IGNORE_INDEX
from fedst.data.clips import collate_clips
from fedst.experiment import ExperimentConfig
from fedst.guard.correction import (
    OUTFED,
    PERSONAL,
    STUDENT_RULE,
    TEACHER_RULE,
    DadLoss,
    GuardConfig,
    GuardedNet,
    GuardError,
    ResidualHeadGenerator,
    dad_loss,
)
from fedst.model.network import FedSTNet
from fedst.progress import progress_bar
from fedst.runs import Run
from fedst.runs.layout import GUARD_DIR, GUARD_FILE, site_state_dir
from fedst.storage import atomic_torch_save, load_checkpoint

log = logging.getLogger("fedst.guard")

# -- which corrections a run has, and their models -------------------------------------------------


@dataclass(frozen=True)
class SitePlan:
    """What DAD does at one site: which model it corrects, from which rounds, supervised or not."""

    site: str
    model: str
    """"personal" (the site's v_k) | "outfed" (the out-of-federation model: held-out site)."""
    student_round: int
    teacher_round: int
    supervised: bool


def guard_file(run_dir: Path, site: str) -> Path:
    """``<site state dir>/guard/dad.pt``: the site's correction."""
    return site_state_dir(run_dir, site) / GUARD_DIR / GUARD_FILE


def check_guard_run(run: Run) -> None:
    """GuardError (one line naming the overrides) unless the run kept validation snapshots and
    had a held-out site, which rules mixed and cbe need."""
    cfg = run.cfg
    missing = []
    if cfg.train.val_every is None or not run.snapshot_rounds():
        missing.append("no validation snapshots (train.val_every)")
    if cfg.selection.held_out_site is None:
        missing.append("no held-out site (selection.held_out_site)")
    if missing:
        raise GuardError(
            f"{run.dir}: {' and '.join(missing)}; DAD's student and teacher are the rounds rules "
            f"mixed and cbe choose, so train the run with train.val_every=<k> "
            f"selection.held_out_site=<a site of data.federation>"
        )


def chosen_rounds(run: Run, device: torch.device, progress: bool = False) -> tuple[int, int]:
    """(student round, teacher round): the rounds of rules mixed and cbe, from validation rows
    only (the held-out site's rows are scored first when the run lacks them)."""
    from fedst.runs.layout import HELD_OUT_ROWS
    from fedst.runs.model_selection import choose, select_rounds, validation_rows

    cfg = run.cfg
    if run.path(HELD_OUT_ROWS).exists():
        choices = choose(
            validation_rows(run.dir),
            cfg.data.federation,
            cfg.selection.held_out_site,
            cfg.selection.metric,
        )
    else:
        choices = select_rounds(run, device, progress)
    return choices[STUDENT_RULE].outfed, choices[TEACHER_RULE].outfed


def site_plans(
    cfg: ExperimentConfig,
    rounds: tuple[int, int],
    settings: GuardConfig,
    sites: Sequence[str] | None = None,
) -> list[SitePlan]:
    """The training sites (their v_k, supervised) and the held-out site (the out-of-federation
    model, zero-shot), or the named subset of them."""
    held_out = cfg.selection.held_out_site
    supervised = settings.supervised_weight > 0
    plans = {s: SitePlan(s, PERSONAL, *rounds, supervised) for s in cfg.data.federation}
    plans[held_out] = SitePlan(held_out, OUTFED, *rounds, supervised=False)
    for site in sites or ():
        if site in cfg.data.out_of_federation:
            raise GuardError(
                f"site {site} is out of federation and has no validation split to fit DAD on; "
                f"it is scored with the held-out site {held_out}'s correction (--site {held_out})"
            )
        if site not in plans:
            raise GuardError(f"--site {site}: not a site of this run; choose from {list(plans)}")
    return [plans[s] for s in sites] if sites else list(plans.values())


def _site_networks(run: Run, plan: SitePlan, device: torch.device) -> tuple[FedSTNet, FedSTNet]:
    """(student, teacher) of a plan, rebuilt from the kept snapshots, in eval mode."""

    def build(server_round: int) -> FedSTNet:
        if plan.model == OUTFED:
            return run.outfed_model(device, round=server_round).eval()
        return run.site_model(plan.site, device, round=server_round).eval()

    return build(plan.student_round), build(plan.teacher_round)


def _new_generator(student: FedSTNet, settings: GuardConfig) -> ResidualHeadGenerator:
    head = student.prediction_head
    return ResidualHeadGenerator(
        head.in_channels, head.out_channels, settings.dist_dim, settings.hidden_dim
    )


def load_guarded_model(run: Run, site: str, device: torch.device) -> GuardedNet:
    """The corrected model saved at ``site`` (a training site: its v_k; the held-out site: the
    out-of-federation model), in eval mode; a missing file is a one-line GuardError."""
    path = guard_file(run.dir, site)
    if not path.exists():
        raise GuardError(
            f"{path} is missing: site {site} has no DAD correction; make it with "
            f"python -m fedst.guard {run.dir} --site {site}"
        )
    record = load_checkpoint(path)
    plan = SitePlan(**record["plan"])
    student, teacher = _site_networks(run, plan, device)
    generator = _new_generator(student, GuardConfig(**record["settings"]))
    generator.load_state_dict(record["generator"])
    return GuardedNet(student, teacher, generator.to(device)).eval()


def held_out_site(cfg: ExperimentConfig) -> str:
    """The site whose correction the out-of-federation model uses."""
    if cfg.selection.held_out_site is None:
        raise GuardError(
            "the run has no held-out site, so no corrected out-of-federation model; train it "
            "with train.val_every=<k> selection.held_out_site=<a site of data.federation>"
        )
    return cfg.selection.held_out_site


# -- fitting DAD at one site (its validation split only) ----------------------------------------


def _batches(dataset: Dataset, batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    """Clips of ``dataset`` (no augmentation), loaded in this process (validation splits are
    small)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=collate_clips,
        generator=torch.Generator().manual_seed(seed),
    )


def _objective(
    model: GuardedNet,
    clips: torch.Tensor,
    masks: torch.Tensor,
    indicator: torch.Tensor | None,
    settings: GuardConfig,
    supervised: bool,
) -> tuple[torch.Tensor, DadLoss]:
    """L_DAD (Eq. 10) plus, when ``supervised``, w_sup * CE(y_final at the labels' size, labels)."""
    outputs = model.head_outputs(clips, indicator)
    loss = dad_loss(outputs.final, outputs.student, outputs.teacher, settings)
    total = loss.total
    if supervised:
        upsampled = F.interpolate(outputs.final, size=masks.shape[-2:], mode="bilinear")
        total = total + settings.supervised_weight * F.cross_entropy(
            upsampled, masks, ignore_index=IGNORE_INDEX
        )
    return total, loss


def fit_dad(
    model: GuardedNet,
    indicator: torch.Tensor | None,
    fit_data: Dataset,
    stop_data: Dataset,
    settings: GuardConfig,
    supervised: bool,
    device: torch.device,
    seed: int,
    progress: bool = False,
    desc: str = "DAD",
) -> dict[str, Any]:
    """Train ``model.generator`` (Adam) on ``fit_data`` for at most ``settings.epochs`` epochs,
    early-stopped on the objective over ``stop_data``; the best epoch's generator is loaded back.
    Returns the history: per epoch the mean fitting and stopping losses."""
    optimizer = torch.optim.Adam(model.generator.parameters(), lr=settings.lr)
    ind = indicator.to(device) if indicator is not None else None

    def stopping_loss() -> tuple[float, float]:
        total, disagree, frames = 0.0, 0.0, 0
        with torch.no_grad():
            for clips, masks, _ in _batches(stop_data, settings.batch_size, False, seed):
                loss, parts = _objective(
                    model, clips.to(device), masks.to(device), ind, settings, supervised
                )
                total += float(loss) * len(clips)
                disagree += parts.disagree_fraction * len(clips)
                frames += len(clips)
        return total / frames, disagree / frames

    stop_loss, disagree = stopping_loss()
    history = [{"epoch": 0, "fit_loss": None, "stop_loss": stop_loss, "disagree": disagree}]
    best = (stop_loss, 0, copy.deepcopy(model.generator.state_dict()))
    epochs = progress_bar(range(1, settings.epochs + 1), desc=desc, enabled=progress)
    for epoch in epochs:
        model.generator.train()
        fit_total, frames = 0.0, 0
        loader = _batches(fit_data, settings.batch_size, True, seed + epoch)
        for clips, masks, _ in progress_bar(
            loader, desc=f"epoch {epoch}", enabled=progress, leave=False
        ):
            loss, _ = _objective(
                model, clips.to(device), masks.to(device), ind, settings, supervised
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            fit_total += float(loss.detach()) * len(clips)
            frames += len(clips)
        model.generator.eval()
        stop_loss, disagree = stopping_loss()
        history.append(
            {
                "epoch": epoch,
                "fit_loss": fit_total / frames,
                "stop_loss": stop_loss,
                "disagree": disagree,
            }
        )
        epochs.set_postfix(stop_loss=f"{stop_loss:.4f}", refresh=False)
        if stop_loss < best[0]:
            best = (stop_loss, epoch, copy.deepcopy(model.generator.state_dict()))
        elif epoch - best[1] >= settings.patience:
            break
    model.generator.load_state_dict(best[2])
    return {"history": history, "best_epoch": best[1], "epochs_run": history[-1]["epoch"]}


def split_for_stopping(num_samples: int, stop_fraction: float, site: str) -> tuple[list, list]:
    """(fitted indices, early-stopping indices): the last round(stop_fraction * n) of the n
    samples (at least one, at most n - 1) are held back."""
    if num_samples < 2:
        raise GuardError(
            f"site {site}: its validation split has {num_samples} labelled frame(s); DAD needs "
            f"at least 2 (fitted and early-stopping frames)"
        )
    held_back = min(num_samples - 1, max(1, round(stop_fraction * num_samples)))
    cut = num_samples - held_back
    return list(range(cut)), list(range(cut, num_samples))


def guard_site(
    run: Run,
    plan: SitePlan,
    settings: GuardConfig,
    device: torch.device,
    progress: bool = False,
) -> Path:
    """Fit DAD at one site on its validation split and save ``<site state dir>/guard/dad.pt``."""
    from fedst.data.splits import validation_dataset

    cfg = run.cfg
    dataset = validation_dataset(cfg.data.open(plan.site), cfg.data.val_split, cfg.clip_config())
    fit, stop = split_for_stopping(len(dataset), settings.stop_fraction, plan.site)
    student, teacher = _site_networks(run, plan, device)
    with torch.random.fork_rng(devices=[]):  # the generator's initialisation, seeded by the run
        torch.manual_seed(cfg.seed)
        generator = _new_generator(student, settings)
    model = GuardedNet(student, teacher, generator.to(device))
    log.info(
        "DAD at %s (%s model): student round %d (rule %s), teacher round %d (rule %s), %s; "
        "%d validation frames fitted, %d held back for early stopping",
        plan.site,
        plan.model,
        plan.student_round,
        STUDENT_RULE,
        plan.teacher_round,
        TEACHER_RULE,
        "supervised" if plan.supervised else "zero-shot",
        len(fit),
        len(stop),
    )
    if plan.student_round == plan.teacher_round:
        log.warning(
            "no model-selection failure (mixed and cbe both chose round %d): teacher = student, "
            "so the distillation terms are zero and only a supervised term can move the head",
            plan.student_round,
        )
    result = fit_dad(
        model,
        run.method.indicators().get(plan.site),
        Subset(dataset, fit),
        Subset(dataset, stop),
        settings,
        plan.supervised,
        device,
        cfg.seed,
        progress,
        desc=f"DAD {plan.site}",
    )
    record = {
        "plan": asdict(plan),
        "rules": {"student": STUDENT_RULE, "teacher": TEACHER_RULE},
        "settings": asdict(settings),
        "generator": {k: v.detach().cpu() for k, v in model.generator.state_dict().items()},
        "fit_frames": len(fit),
        "stop_frames": len(stop),
        "id": uuid.uuid4().hex,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        **result,
    }
    path = guard_file(run.dir, plan.site)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(record, path)
    log.info(
        "DAD at %s: best epoch %d of %d run (early-stopping loss %.4f -> %.4f); wrote %s",
        plan.site,
        result["best_epoch"],
        result["epochs_run"],
        result["history"][0]["stop_loss"],
        result["history"][result["best_epoch"]]["stop_loss"],
        path,
    )
    return path


def run_guard(
    run: Run,
    settings: GuardConfig = GuardConfig(),  # noqa: B008 (frozen: an immutable default)
    sites: Sequence[str] | None = None,
    progress: bool = False,
) -> list[Path]:
    """DAD at every site of the run (or ``sites``), each on its own validation split."""
    cfg = run.cfg
    check_guard_run(run)
    device = run.device
    rounds = chosen_rounds(run, device, progress)
    plans = site_plans(cfg, rounds, settings, sites)
    return [guard_site(run, plan, settings, device, progress) for plan in plans]
