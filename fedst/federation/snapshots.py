"""What model selection keeps of every validation round, and the models rebuilt from it.

A site keeps only its two latest private states (fedst/federation/site.py), so the rounds that
selection may choose (those scored on validation, ``train.val_every``) keep a copy each:

* the server: ``<run>/selection/shared_rNNNN.pt`` = {"round", "shared": gamma_g after round N};
* each site: ``<site state dir>/selection/personal_rNNNN.pt`` = {"round", "site", "personal":
  rho_k after round N, "num_examples"}: exactly the rho_k its validation score was measured with.

v_k at round N is gamma_g^N U rho_k^N (:func:`snapshot_site_model`); the out-of-federation model
at round N is gamma_g^N U the sample-count-weighted average of every training site's rho_k^N
(:func:`snapshot_outfed_model`, the same average as fedst/outfed.py). In simulation the sites'
folders are inside the run directory; a deployed site keeps its copies on its own disk.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fedst.experiment import ExperimentConfig, site_state_dir
from fedst.federation.run_io import atomic_torch_save, load_checkpoint
from fedst.methods import method_of
from fedst.model.network import FedSTNet
from fedst.model.state import load_subset

log = logging.getLogger(__name__)

SELECTION_DIR = "selection"


def shared_snapshot_path(run_dir: Path, server_round: int) -> Path:
    return run_dir / SELECTION_DIR / f"shared_r{server_round:04d}.pt"


def personal_snapshot_path(state_dir: Path, server_round: int) -> Path:
    return state_dir / SELECTION_DIR / f"personal_r{server_round:04d}.pt"


def save_shared_snapshot(run_dir: Path, server_round: int, shared: dict[str, torch.Tensor]) -> None:
    """The server's gamma_g after ``server_round`` (a validation round)."""
    path = shared_snapshot_path(run_dir, server_round)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save({"round": server_round, "shared": shared}, path)


def save_personal_snapshot(
    state_dir: Path,
    server_round: int,
    site: str,
    personal: dict[str, torch.Tensor],
    num_examples: int,
) -> None:
    """A site's rho_k after ``server_round`` (a validation round), kept on the site's disk."""
    path = personal_snapshot_path(state_dir, server_round)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(
        {
            "round": server_round,
            "site": site,
            "personal": personal,
            "num_examples": num_examples,
        },
        path,
    )


def snapshot_rounds(run_dir: Path) -> list[int]:
    """Rounds whose shared snapshot the run directory holds, ascending."""
    folder = run_dir / SELECTION_DIR
    return sorted(int(p.stem.split("_r")[1]) for p in folder.glob("shared_r*.pt"))


def _load(path: Path, what: str) -> dict:
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: {what} was not kept. Only rounds scored on validation "
            f"(train.val_every) keep their models; choose one of those rounds"
        )
    return load_checkpoint(path)


def _model(
    cfg: ExperimentConfig,
    run_dir: Path,
    server_round: int,
    personal: dict[str, torch.Tensor],
    device: torch.device,
) -> FedSTNet:
    model = method_of(cfg).build_model()
    if method_of(cfg).communicates:
        shared = _load(
            shared_snapshot_path(run_dir, server_round), f"gamma_g of round {server_round}"
        )
        load_subset(model, shared["shared"])
    load_subset(model, personal)
    return model.to(device)


def snapshot_site_model(
    cfg: ExperimentConfig, run_dir: Path, site: str, server_round: int, device: torch.device
) -> FedSTNet:
    """v_k = gamma_g^N U rho_k^N of site ``site`` after validation round ``server_round``."""
    state = _load(
        personal_snapshot_path(site_state_dir(run_dir, site), server_round),
        f"site {site}'s rho_k of round {server_round}",
    )
    return _model(cfg, run_dir, server_round, state["personal"], device)


def snapshot_outfed_model(
    cfg: ExperimentConfig, run_dir: Path, server_round: int, device: torch.device
) -> FedSTNet:
    """gamma_g^N U the n_k-weighted average of every training site's rho_k^N (fedst/outfed.py's
    out-of-federation model, at validation round ``server_round``)."""
    states = [
        _load(
            personal_snapshot_path(site_state_dir(run_dir, site), server_round),
            f"site {site}'s rho_k of round {server_round}",
        )
        for site in cfg.data.federation
    ]
    from fedst.outfed import sample_weighted_personal  # outfed builds on run files, as this

    return _model(cfg, run_dir, server_round, sample_weighted_personal(states), device)
