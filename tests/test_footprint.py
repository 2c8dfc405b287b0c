"""What a finished run keeps on disk (issue 46's footprint policy, fedst/runs/footprint.py): its
models, and nothing that only resuming it would read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fedst.cli import compose_experiment
from fedst.federation.site import Site
from fedst.model.network import build_network
from fedst.runs import Run
from fedst.runs.footprint import folder_bytes, keep_models_only
from fedst.runs.layout import SERVER_CHECKPOINT, saved_rounds
from fedst.runs.outfed import evaluate_out_of_federation
from fedst.storage import CheckpointError
from fedst.training import run_training


@pytest.fixture(scope="module")
def finished(tiny_run):
    """A finished tiny FedST run (2 rounds, SERQ on) with the default train.keep_resume_state:
    the session's (tests/conftest.py), read only."""
    cfg, run_dir, _ = tiny_run
    assert cfg.method.serq and not cfg.train.keep_resume_state and cfg.train.rounds == 2
    return cfg, run_dir


def test_a_finished_fedst_run_keeps_each_sites_last_model_and_a_server_checkpoint_without_v_g(
    finished,
):
    """FedST's sites return v_k = gamma_k U rho_k: no returned model reads v_g."""
    cfg, run_dir = finished
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["server.pt"]
    server = torch.load(run_dir / SERVER_CHECKPOINT, weights_only=False)
    assert server["round"] == 2 and not {"global_model", "method"} & set(server)
    for site in cfg.data.federation:
        assert saved_rounds(run_dir / "sites" / site) == [2]
        state = torch.load(run_dir / "sites" / site / "state_r0002.pt", weights_only=False)
        assert "personal" in state and "shared" in state  # rho_k and gamma_k
        assert not {"optimizer", "stream"} & set(state)  # no AdamW moments, no data order


def test_a_finished_tiny_fedst_run_takes_the_bytes_of_its_four_returned_models(finished):
    """The four v_k (rho_k and gamma_k of the last round): 4 x the network's fp32 bytes, counted
    from the network itself, plus pickling overhead under 1 %; the whole run under 100 MB."""
    cfg, run_dir = finished
    network = build_network(cfg.network)
    model_bytes = sum(t.numel() * t.element_size() for t in network.state_dict().values())
    checkpoints = folder_bytes(run_dir / "checkpoints") + folder_bytes(run_dir / "sites")
    assert 4 * model_bytes <= checkpoints <= 1.01 * 4 * model_bytes
    assert folder_bytes(run_dir) <= 100e6


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


@pytest.fixture(scope="module")
def fedavg_kept_and_slimmed(tmp_path_factory: pytest.TempPathFactory, finished):
    """A finished tiny FedAvg run (1 round, no SERQ) that kept everything
    (train.keep_resume_state=true), and a copy of it slimmed by keep_models_only."""
    root = Path(finished[0].data.root)  # the FedST run's tiny data
    overrides = ["experiment=tiny", "method=fedavg", "method.serq=false", "train.total_iters=2"]
    kept_cfg = compose_experiment(
        [*overrides, f"data.root={root}", "train.keep_resume_state=true"]
    )[0]
    kept = tmp_path_factory.mktemp("runs") / "fedavg"
    run_training(kept_cfg, kept, progress=False)
    slimmed = kept.parent / "fedavg_slimmed"
    shutil.copytree(kept, slimmed)
    keep_models_only(Run(slimmed))
    return kept_cfg, kept, slimmed


def test_a_finished_fedavg_run_keeps_v_g_and_each_sites_rho_k_without_its_gamma_k(
    fedavg_kept_and_slimmed,
):
    """FedAvg's sites return v_k = gamma_g U rho_k: their own gamma_k is read by no model."""
    cfg, _, slimmed = fedavg_kept_and_slimmed
    server = torch.load(slimmed / SERVER_CHECKPOINT, weights_only=False)
    assert "global_model" in server and "method" not in server
    network = build_network(cfg.network)
    model_bytes = sum(t.numel() * t.element_size() for t in network.state_dict().values())
    for site in cfg.data.federation:
        state = torch.load(slimmed / "sites" / site / "state_r0001.pt", weights_only=False)
        assert "personal" in state and "shared" not in state
    checkpoints = folder_bytes(slimmed / "checkpoints") + folder_bytes(slimmed / "sites")
    assert checkpoints <= 1.5 * model_bytes  # v_g and four rho_k (the encoder queries, CS network)


def test_slimming_a_finished_run_leaves_every_returned_model_bit_for_bit(fedavg_kept_and_slimmed):
    _, kept, slimmed = fedavg_kept_and_slimmed
    cpu = torch.device("cpu")
    full, slim = Run(kept), Run(slimmed)
    pairs = [(full.site_model(s, cpu), slim.site_model(s, cpu)) for s in full.cfg.data.federation]
    pairs.append((full.outfed_model(cpu), slim.outfed_model(cpu)))
    for before, after in pairs:
        for (key, tensor), (key_after, tensor_after) in zip(
            before.state_dict().items(), after.state_dict().items(), strict=True
        ):
            assert key == key_after and torch.equal(tensor, tensor_after), key
