"""Disk cost of what model selection keeps per validation round (fedst/federation/snapshots.py).

``python -m bench.selection_disk [overrides ...]`` (default: the demo experiment) builds the
method's model, writes one shared snapshot and one personal snapshot per training site with the
functions training uses, and prints their sizes and the total over the run's validation rounds
(``train.val_every``, default 4 here, plus the last round). It also prints a site's full private
state file (state_rNNNN.pt with optimizer moments) for comparison: keeping that instead of the
personal copy would cost this much per round and site. Nothing is trained.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from fedst.cli import compose_experiment
from fedst.federation.snapshots import save_personal_snapshot, save_shared_snapshot
from fedst.methods import method_of
from fedst.model.state import state_subset
from fedst.runs.layout import personal_snapshot_path, shared_snapshot_path

MB = 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides of experiment=demo, e.g. method=fedavg"
    )
    overrides = parser.parse_args(argv).overrides
    if not any(o.startswith("train.val_every=") for o in overrides):
        overrides = [*overrides, "train.val_every=4"]
    cfg, _ = compose_experiment(["experiment=demo", *overrides])
    method = method_of(cfg)
    model = method.build_model()
    partition = method.partition(model)
    shared = state_subset(model, partition.shared) if method.communicates else {}
    personal = state_subset(model, partition.personal)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():  # one step so the optimizer holds its two moments per tensor
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        save_shared_snapshot(root, 1, shared)
        save_personal_snapshot(root / "site", 1, "A", personal, 1)
        torch.save({"personal": personal, "optimizer": optimizer.state_dict()}, root / "state.pt")
        shared_mb = shared_snapshot_path(root, 1).stat().st_size / MB
        personal_mb = personal_snapshot_path(root / "site", 1).stat().st_size / MB
        state_mb = (root / "state.pt").stat().st_size / MB
    rounds, every = cfg.train.rounds, cfg.train.val_every
    kept = len({*range(every, rounds + 1, every), rounds})
    sites = len(cfg.data.federation)
    total = kept * (shared_mb + sites * personal_mb)
    print(
        f"{cfg.name} / {cfg.method.name}: {rounds} rounds, val_every {every} -> {kept} kept rounds; "
        f"per kept round: shared {shared_mb:.2f} MB (server) + personal {personal_mb:.3f} MB x "
        f"{sites} sites; total {total:.1f} MB (a full private state file is {state_mb:.2f} MB)"
    )


if __name__ == "__main__":
    main()
