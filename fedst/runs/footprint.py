"""What a run keeps on disk once its training has finished (issue 46's footprint policy).

While a run trains it keeps what resuming it needs (fedst/runs/layout.py): the server's last two
checkpoints (``server.pt`` with SERQ's synthetic model v_pre and both Adam states, and
``server.prev.pt``, the fallback when the latest is damaged), SERQ's feature bank, and per site
its states of the server's checkpoint rounds and of the round before (rho_k, gamma_k, AdamW
moments, data order). A finished run is never resumed (fedst/runs/files.py ``unfinished``), so
at its end (``train.keep_resume_state=false``, the default) :func:`keep_models_only` leaves what
its results, ``eval_outfed.py``, ``fedst.infer``, model selection and the report read, and each
tensor of it once, as written (no lossy compression):

* ``checkpoints/server.pt``: the round, ``shared_keys``, ``extra``, and v_g (``global_model``)
  where the returned models read gamma_g (``method.returned_model=global``: v_k = gamma_g U
  rho_k, or a site state without its own gamma_k);
* per site its latest state (that of the last round): rho_k and ``num_examples``, with its own
  gamma_k where the site returns it (``own``: v_k = gamma_k U rho_k, FedST; after local training
  gamma_k differs from gamma_g in every tensor, so the four v_k are the run's models and v_g,
  which no returned model reads, is dropped);
* every validation round's selection snapshots, which model selection reads (``selection/``;
  gamma_g in ``shared_rNNNN.pt`` only where the returned models read it, else just its round,
  by which the validation rounds are listed);
* the logs, final.json, tables and plots.

Gone: ``server.prev.pt``, SERQ's state (v_pre, its Adam state and the global model's) and
feature bank, the sites' optimizer moments, loss scaler, data order and method state
(FedAS's local base), their states of earlier rounds, and the copy of each model's shared part
that its returned model does not read. ``train.keep_resume_state=true`` keeps everything. Sizes
before / after: docs/running.md.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from fedst.methods.feature_bank import FEATURE_BANK_DIR
from fedst.runs import layout
from fedst.storage import atomic_torch_save, load_checkpoint

if TYPE_CHECKING:
    from fedst.runs.run import Run

log = logging.getLogger(__name__)

SERVER_DROPPED = ("method",)
"""The entries of ``server.pt`` a finished run drops: the method's and its server step's state
(SERQ: v_pre and both Adam states). It keeps ``shared_keys``, the round, ``extra`` and v_g where
a returned model reads gamma_g."""
SITE_DROPPED = ("optimizer", "scaler", "stream", "method")
"""The entries of a site's ``state_rNNNN.pt`` a finished run drops: its AdamW moments, loss
scaler, data order and method state. It keeps rho_k, ``num_examples`` and, where the site returns
its own model, gamma_k."""


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def keep_models_only(run: Run) -> tuple[int, int]:
    """Remove from the finished ``run`` what only resuming it would read and what its returned
    models do not read (the module docstring); returns the run directory's bytes before and
    after."""
    run_dir = run.dir
    before = folder_bytes(run_dir)
    last_states = {}
    sites = run_dir / layout.SITES_DIR
    for state_dir in sorted(p for p in sites.iterdir() if p.is_dir()) if sites.is_dir() else []:
        rounds = layout.saved_rounds(state_dir)
        if not rounds:
            continue
        for stale in rounds[:-1]:  # the site's latest state stays (the last round's, normally)
            layout.site_state_file(state_dir, stale).unlink()
        last = layout.site_state_file(state_dir, rounds[-1])
        last_states[last] = load_checkpoint(last)
    own_models = run.method.returns_own_model
    reads_global_shared = not (  # own models, each with its gamma_k, read no gamma_g
        own_models
        and last_states
        and all(state.get("shared") is not None for state in last_states.values())
    )
    dropped_by_sites = (*SITE_DROPPED, *(() if own_models else ("shared",)))
    for path, state in last_states.items():
        atomic_torch_save({k: v for k, v in state.items() if k not in dropped_by_sites}, path)
    server_pt = run_dir / layout.SERVER_CHECKPOINT
    saved = load_checkpoint(server_pt)
    dropped_by_server = (*SERVER_DROPPED, *(() if reads_global_shared else ("global_model",)))
    atomic_torch_save({k: v for k, v in saved.items() if k not in dropped_by_server}, server_pt)
    if not reads_global_shared:  # each file stays, with its round: the rounds selection lists
        for server_round in layout.snapshot_rounds(run_dir):
            snapshot = layout.shared_snapshot_path(run_dir, server_round)
            atomic_torch_save({"round": server_round}, snapshot)
    (run_dir / layout.SERVER_PREVIOUS).unlink(missing_ok=True)
    shutil.rmtree(run_dir / FEATURE_BANK_DIR, ignore_errors=True)
    after = folder_bytes(run_dir)
    log.info(
        "finished run: kept its models only, %.1f MB -> %.1f MB (train.keep_resume_state=true "
        "keeps what resuming would need)",
        before / 1e6,
        after / 1e6,
    )
    return before, after
