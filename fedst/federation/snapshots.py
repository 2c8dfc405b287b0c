"""What model selection keeps of every validation round, and the models rebuilt from it.

A site keeps only its two latest private states (fedst/federation/site.py), so the rounds that
selection may choose (those scored on validation, ``train.val_every``) keep a copy each:

* the server: ``<run>/selection/shared_rNNNN.pt`` = {"round", "shared": gamma_g after round N};
* each site: ``<site state dir>/selection/personal_rNNNN.pt`` = {"round", "site", "personal":
  rho_k after round N, "num_examples"}: exactly the rho_k its validation score was measured with.

The models are rebuilt from them by fedst/runs/run.py: v_k at round N is the model the site
returned (``Run.site_model(site, device, round=N)``: gamma_k^N U rho_k^N, the snapshot then also
holds the site's own gamma_k^N, or gamma_g^N U rho_k^N, by method.returned_model); the
out-of-federation model at round N is the sample-count-weighted average of them
(``Run.outfed_model(device, round=N)``). In simulation the sites' folders are inside the run
directory; a deployed site keeps its copies on its own disk.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fedst.runs.layout import personal_snapshot_path, shared_snapshot_path
from fedst.storage import atomic_torch_save

log = logging.getLogger(__name__)


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
