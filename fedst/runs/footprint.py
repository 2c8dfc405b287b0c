"""What a run keeps on disk once its training has finished (issue 46's footprint policy).

While a run trains it keeps what resuming it needs (fedst/runs/layout.py): the server's last two
checkpoints (``server.pt`` with SERQ's synthetic model v_pre and both Adam states, and
``server.prev.pt``, the fallback when the latest is damaged), SERQ's feature bank, and per site
its states of the server's checkpoint rounds and of the round before (rho_k, gamma_k, AdamW
moments, data order). A finished run is never resumed (fedst/runs/files.py ``unfinished``), so
at its end (``train.keep_resume_state=false``, the default) :func:`keep_models_only` leaves what
its results, ``eval_outfed.py``, ``fedst.infer`` and the report read:

* ``checkpoints/server.pt``: the round, v_g (``global_model``), ``shared_keys`` and ``extra``;
* per site its latest state (that of the last round): rho_k, its own gamma_k, ``num_examples``;
* every validation round's selection snapshots (``selection/``), which model selection reads;
* the logs, final.json, tables and plots.

Gone: ``server.prev.pt``, SERQ's state (v_pre, its Adam state and the global model's) and
feature bank, the sites' optimizer moments, loss scaler, data order and method state
(FedAS's local base), and their states of earlier rounds. Sizes before / after: docs/running.md.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from fedst.methods.feature_bank import FEATURE_BANK_DIR
from fedst.runs import layout
from fedst.storage import atomic_torch_save, load_checkpoint

log = logging.getLogger(__name__)

SERVER_DROPPED = ("method",)
"""The entries of ``server.pt`` a finished run drops: the method's and its server step's state
(SERQ: v_pre and both Adam states). It keeps v_g, ``shared_keys``, the round and ``extra``."""
SITE_DROPPED = ("optimizer", "scaler", "stream", "method")
"""The entries of a site's ``state_rNNNN.pt`` a finished run drops: its AdamW moments, loss
scaler, data order and method state. It keeps rho_k, gamma_k and ``num_examples``."""


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def keep_models_only(run_dir: Path) -> tuple[int, int]:
    """Remove from the finished run in ``run_dir`` what only resuming it would read (the module
    docstring); returns the run directory's bytes before and after."""
    before = folder_bytes(run_dir)
    server_pt = run_dir / layout.SERVER_CHECKPOINT
    saved = load_checkpoint(server_pt)
    atomic_torch_save({k: v for k, v in saved.items() if k not in SERVER_DROPPED}, server_pt)
    (run_dir / layout.SERVER_PREVIOUS).unlink(missing_ok=True)
    shutil.rmtree(run_dir / FEATURE_BANK_DIR, ignore_errors=True)
    sites = run_dir / layout.SITES_DIR
    for state_dir in sorted(p for p in sites.iterdir() if p.is_dir()) if sites.is_dir() else []:
        rounds = layout.saved_rounds(state_dir)
        if not rounds:
            continue
        for stale in rounds[:-1]:  # the site's latest state stays (the last round's, normally)
            layout.site_state_file(state_dir, stale).unlink()
        last = layout.site_state_file(state_dir, rounds[-1])
        state = load_checkpoint(last)
        atomic_torch_save({k: v for k, v in state.items() if k not in SITE_DROPPED}, last)
    after = folder_bytes(run_dir)
    log.info(
        "finished run: kept its models only, %.1f MB -> %.1f MB (train.keep_resume_state=true "
        "keeps what resuming would need)",
        before / 1e6,
        after / 1e6,
    )
    return before, after
