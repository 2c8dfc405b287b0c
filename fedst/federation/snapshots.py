"""What model selection keeps of every validation round, and the models rebuilt from it.

A site keeps only its two latest private states (fedst/federation/site.py), so the rounds that
selection may choose (those scored on validation, ``train.val_every``) keep a copy each:

* the server: ``<run>/selection/shared_rNNNN.pt`` = {"round", "shared": gamma_g after round N};
* each site: ``<site state dir>/selection/personal_rNNNN.pt`` = {"round", "site", "personal":
  rho_k after round N, "num_examples"}: exactly the rho_k its validation score was measured with.

v_k at round N is the model the site returned (:func:`snapshot_site_model`: gamma_k^N U rho_k^N,
the snapshot then also holds the site's own gamma_k^N, or gamma_g^N U rho_k^N, by
method.returned_model); the out-of-federation model at round N is the sample-count-weighted
average of them (:func:`snapshot_outfed_model`, the same average as fedst/outfed.py, both from
fedst/federation/returned.py). In simulation the sites'
folders are inside the run directory; a deployed site keeps its copies on its own disk.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fedst.experiment import ExperimentConfig, site_state_dir
from fedst.federation.returned import averaged_site_model, site_model
from fedst.federation.run_io import atomic_torch_save, load_checkpoint
from fedst.methods import method_of
from fedst.model.network import FedSTNet

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
    shared: dict[str, torch.Tensor] | None = None,
) -> None:
    """A site's rho_k after ``server_round`` (a validation round), kept on the site's disk; with
    ``shared`` its own gamma_k too (method.returned_model=own: the model it returns)."""
    path = personal_snapshot_path(state_dir, server_round)
    path.parent.mkdir(parents=True, exist_ok=True)
    snapshot = {
        "round": server_round,
        "site": site,
        "personal": personal,
        "num_examples": num_examples,
    }
    if shared is not None:
        snapshot["shared"] = shared
    atomic_torch_save(snapshot, path)


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


def _global_shared(cfg: ExperimentConfig, run_dir: Path, server_round: int) -> dict:
    """gamma_g of validation round ``server_round`` (empty when the method sends nothing)."""
    if not method_of(cfg).communicates:
        return {}
    path = shared_snapshot_path(run_dir, server_round)
    return _load(path, f"gamma_g of round {server_round}")["shared"]


def _site_snapshot(run_dir: Path, site: str, server_round: int) -> dict:
    return _load(
        personal_snapshot_path(site_state_dir(run_dir, site), server_round),
        f"site {site}'s rho_k of round {server_round}",
    )


def snapshot_site_model(
    cfg: ExperimentConfig, run_dir: Path, site: str, server_round: int, device: torch.device
) -> FedSTNet:
    """The model site ``site`` returned after validation round ``server_round`` (gamma_k^N or
    gamma_g^N by method.returned_model, U rho_k^N)."""
    state = _site_snapshot(run_dir, site, server_round)
    return site_model(cfg, state, _global_shared(cfg, run_dir, server_round), device)


def snapshot_outfed_model(
    cfg: ExperimentConfig, run_dir: Path, server_round: int, device: torch.device
) -> FedSTNet:
    """The n_k-weighted average of every training site's returned model at validation round
    ``server_round`` (fedst/outfed.py's out-of-federation model, at that round)."""
    states = [
        {**_site_snapshot(run_dir, site, server_round), "site": site}
        for site in cfg.data.federation
    ]
    return averaged_site_model(cfg, states, _global_shared(cfg, run_dir, server_round), device)
