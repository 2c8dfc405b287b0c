"""What a finished run keeps on disk (issue 46's footprint policy, fedst/runs/footprint.py): its
models, and nothing that only resuming it would read."""

from __future__ import annotations

import json

import pytest
import torch

from fedst.cli import compose_experiment
from fedst.data.procedural import generate
from fedst.federation.site import Site
from fedst.model.network import build_network
from fedst.runs import Run
from fedst.runs.footprint import folder_bytes
from fedst.runs.layout import SERVER_CHECKPOINT, saved_rounds
from fedst.runs.outfed import evaluate_out_of_federation
from fedst.storage import CheckpointError
from fedst.training import run_training


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory):
    """A finished tiny FedST run (2 rounds, SERQ on) with the default train.keep_resume_state."""
    root = tmp_path_factory.mktemp("data") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    cfg = compose_experiment(["experiment=tiny", f"data.root={root}"])[0]
    assert cfg.method.serq and not cfg.train.keep_resume_state and cfg.train.rounds == 2
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    run_training(cfg, run_dir, progress=False)
    return cfg, run_dir


def test_a_finished_run_keeps_one_server_checkpoint_and_each_sites_last_state_without_optimizer(
    finished,
):
    cfg, run_dir = finished
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["server.pt"]
    server = torch.load(run_dir / SERVER_CHECKPOINT, weights_only=False)
    assert "global_model" in server and "method" not in server  # v_g, not SERQ's state
    for site in cfg.data.federation:
        assert saved_rounds(run_dir / "sites" / site) == [2]
        state = torch.load(run_dir / "sites" / site / "state_r0002.pt", weights_only=False)
        assert "personal" in state and "shared" in state  # rho_k and gamma_k
        assert not {"optimizer", "stream"} & set(state)  # no AdamW moments, no data order


def test_a_finished_tiny_run_takes_the_bytes_of_its_five_models(finished):
    """v_g and four v_k (rho_k and gamma_k of the last round): 5 x the network's fp32 bytes,
    counted from the network itself, plus pickling overhead under 1 %."""
    cfg, run_dir = finished
    network = build_network(cfg.network)
    model_bytes = sum(t.numel() * t.element_size() for t in network.state_dict().values())
    checkpoints = folder_bytes(run_dir / "checkpoints") + folder_bytes(run_dir / "sites")
    assert 5 * model_bytes <= checkpoints <= 1.01 * 5 * model_bytes


def test_the_kept_models_score_what_final_json_says(finished):
    """final.json was scored before the run was slimmed: the kept models give the same scores."""
    cfg, run_dir = finished
    final = json.loads((run_dir / "final.json").read_text())
    scored = evaluate_out_of_federation(Run(run_dir, cfg), torch.device("cpu"), sites=("E",))
    assert scored["E"].summary["dice"] == pytest.approx(final["out_of_federation"]["E"]["dice"])


def test_a_finished_runs_site_state_is_scored_but_not_trained_on(finished):
    """Training on from a state without AdamW moments and data order would silently differ from
    the run it continues: refused, naming train.keep_resume_state."""
    cfg, run_dir = finished
    site = Site("A", cfg, run_dir / "sites" / "A", torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"train\.keep_resume_state=true"):
        site.train_round({}, server_round=3, local_iters=1)
