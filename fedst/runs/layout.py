"""Where a run's files are: every name under a run directory, in one module.

```
config.json / config.yaml   resolved experiment config (config.yaml also holds Hydra's view)
metrics.jsonl               per-round evaluation rows (site, model, dice, iou, hd95, assd, per_class)
train.jsonl                 per-round training rows (site, loss, seconds, loader_seconds: of those,
                            the wait for batches, iterations, process: the site's process id,
                            site_built: the site was built since its previous row,
                            state_restores: states it loaded from disk since); site "server":
                            aggregation_seconds, seconds (aggregation + server step), SERQ losses,
                            eq_seconds and sc_seconds, checkpoint_seconds, checkpoint_bytes and
                            bank_entries_written (the round's server checkpoint),
                            evaluation_seconds / evaluation_frames and validation_seconds (rounds
                            that evaluate), round_seconds (the whole round), rss_bytes and
                            peak_rss_bytes (the server process; in-process: the whole job) and
                            <phase>_peak_rss_bytes, its peak during each phase of the round
                            (train, server_step, evaluation, checkpoint; Linux); where the
                            server computes on CUDA also cuda_allocated_bytes,
                            cuda_reserved_bytes, cuda_peak_bytes (allocated),
                            cuda_peak_reserved_bytes and per phase
                            <phase>_cuda_peak_allocated_bytes / _reserved_bytes; a site's row
                            has cuda_peak_allocated_bytes / cuda_peak_reserved_bytes of its
                            round where it computes on CUDA (absent on the CPU, never zero)
device.jsonl                per start or resume of the server: the device, card, autocast dtype,
                            TF32, cudnn.benchmark, deterministic and compile it ran with
site_stats.json             each site's data statistics, answered before training (frames, class
                            shares, colours, sizes; fedst/data/stats.py), with encoding warnings
comm.jsonl                  parameter bytes uploaded / downloaded per site per round
participation.jsonl         per round: the sites whose training replies were aggregated, and the missing
wire.jsonl                  (deploy.audit) record names, keys and shapes of every message
personal_export.json        (deployment) sites that sent rho_k at the end / declined / were unreachable
checkpoints/server.pt       last completed round: global model, SERQ state but its bank, RNG (atomic)
checkpoints/feature_bank/   SERQ's feature bank: one file per entry and round written
                            (fedst/methods/feature_bank.py); only changed entries each round
checkpoints/server.prev.pt  the round before (fallback when server.pt is damaged)
serq_bank.work              (serq.bank_storage=disk) SERQ's working bank while the server runs,
                            deleted at the end; not a checkpoint (refilled from feature_bank/)
sites/<site>/state_rNNNN.pt a site's private state after round N (in-process: written by the site;
                            deployment: only rho_k of sites that sent it at the end)
selection/shared_rNNNN.pt   gamma_g after validation round N (what model selection may choose)
sites/<site>/selection/personal_rNNNN.pt
                            the site's rho_k (and own gamma_k) after validation round N
external/<site>.json        a new site scored by eval_outfed.py site_root=... (never final.json);
                            an unfinished run's: external/<site>_rNNNN.json (round N scored)
final.json, tables/, plots/ written at the end
tensorboard/                scalars of all of the above
```

A deployed site keeps its ``sites/<site>`` folder on its own disk (its state folder).
A finished run keeps of these only what its returned models, selection and report read
(fedst/runs/footprint.py; ``train.keep_resume_state=true`` keeps all).
"""

from __future__ import annotations

import re
from pathlib import Path

from fedst.schema.feature_bank import SERQ_BANK_SCRATCH as SERQ_BANK_SCRATCH

CONFIG_JSON = "config.json"
CONFIG_YAML = "config.yaml"
FINAL_JSON = "final.json"
METRICS_JSONL = "metrics.jsonl"
TRAIN_JSONL = "train.jsonl"
COMM_JSONL = "comm.jsonl"
DEVICE_JSONL = "device.jsonl"
BENCHMARK_JSON = "benchmark.json"
SITE_STATS_JSON = "site_stats.json"
"""Each site's data statistics, sent before training (fedst/app/site_statistics.py)."""
"""Which procedural benchmark (seed, preset, generator version per site) the run used."""
IID_PARTITION_JSON = "iid_partition.json"
"""The pooled-and-redistributed partition of an ``data.iid`` control run."""
LOG_TXT = "log.txt"
FLWR_RUN_LOG = "flwr_run.log"
"""(deployment) the output of ``flwr run`` that started the deployed ServerApp."""
PLOTS_DIR = "plots"
TABLES_DIR = "tables"
STATE_FINGERPRINT = "fingerprint.json"
"""In a site's state folder: what its saved states were trained on (the data's fingerprint)."""
SERVER_CHECKPOINT = "checkpoints/server.pt"
SERVER_PREVIOUS = "checkpoints/server.prev.pt"
"""The checkpoint of the round before SERVER_CHECKPOINT's: the fallback when the latest is damaged."""
SITES_DIR = "sites"
SELECTION_DIR = "selection"
PERSONAL_EXPORT = "personal_export.json"
"""Written by the deployed server (fedst/app/after_rounds.py): which sites sent rho_k at the end."""
EXTERNAL_DIR = "external"
"""Sub-folder of a run directory with the results of new sites (never final.json)."""
EXTERNAL_TABLE = "results.md"
HELD_OUT_ROWS = f"{SELECTION_DIR}/held_out_val.jsonl"
"""The held-out site's validation rows of every validation round (model selection, ``cbe``)."""
SELECTION_FILE = f"{SELECTION_DIR}/selection.json"
"""The rounds each selection rule chose and the chosen models' test scores."""
GUARD_SCORES = f"{SELECTION_DIR}/guard.json"
"""GEN-Guard's DAD: the corrected models' test scores."""
GUARD_DIR = "guard"
GUARD_FILE = "dad.pt"
"""In ``sites/<site>/guard/``: the site's DAD-corrected head."""
FPS_JSON = "fps.json"
"""Streaming inference speed of the run's model (fedst.paper's Table V)."""


def outfed_result(run_dir: Path, tag: str = "", round_suffix: str = "") -> Path:
    """Where eval_outfed.py writes scores that are not final.json's: ``outfed<tag><suffix>.json``
    (tag: ``_<sites>`` or ``_dad_<sites>``; suffix: ``_rNNNN`` for an unfinished run)."""
    return run_dir / f"outfed{tag}{round_suffix}.json"


def external_result(run_dir: Path, site: str, round_suffix: str = "") -> Path:
    """A new site's scores (eval_outfed.py site_root=...), never final.json."""
    return run_dir / EXTERNAL_DIR / f"{site}{round_suffix}.json"


def site_state_dir(run_dir: Path, site: str) -> Path:
    """A site's state folder when it is inside the run directory (simulation)."""
    return run_dir / SITES_DIR / site


def site_state_file(state_dir: Path, server_round: int) -> Path:
    """Where a site keeps its private state after ``server_round``."""
    return state_dir / f"state_r{server_round:04d}.pt"


def saved_rounds(state_dir: Path) -> list[int]:
    """Rounds whose private state is in ``state_dir``, ascending."""
    found = (re.fullmatch(r"state_r(\d{4,})\.pt", p.name) for p in state_dir.glob("state_r*.pt"))
    return sorted(int(m.group(1)) for m in found if m)


def shared_snapshot_path(run_dir: Path, server_round: int) -> Path:
    """The server's gamma_g after validation round ``server_round``."""
    return run_dir / SELECTION_DIR / f"shared_r{server_round:04d}.pt"


def personal_snapshot_path(state_dir: Path, server_round: int) -> Path:
    """A site's rho_k (and own gamma_k) after validation round ``server_round``."""
    return state_dir / SELECTION_DIR / f"personal_r{server_round:04d}.pt"


def snapshot_rounds(run_dir: Path) -> list[int]:
    """Rounds whose shared snapshot the run directory holds, ascending."""
    folder = run_dir / SELECTION_DIR
    return sorted(int(p.stem.split("_r")[1]) for p in folder.glob("shared_r*.pt"))
