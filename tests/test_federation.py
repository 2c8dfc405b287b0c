"""Specifications of the federation: Flower apps, privacy, aggregation, SERQ, resume, NaN guard.

Every end-to-end test runs the real entry-point path (Hydra config -> run_training ->
ServerApp/ClientApp over the in-process Grid) on the tiny procedural preset.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedMedian
from hydra import compose, initialize_config_dir

from fedst.app import server_app
from fedst.app.client_app import app as client_app
from fedst.app.inprocess import InProcessGrid
from fedst.cli import register_resolvers, split_config
from fedst.data.procedural import generate
from fedst.experiment import ExperimentConfig
from fedst.federation import site as site_module
from fedst.federation.components import build_model, partition_of
from fedst.federation.server import FederationServer
from fedst.training import run_training

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def experiment(root: Path, *overrides: str) -> ExperimentConfig:
    register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=tiny", f"data.root={root}", *overrides])
    return split_config(cfg)[0]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- one tiny federation, inspected from every side ------------------------------------------------


@pytest.fixture(scope="module")
def fedst_run(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """A 2-round FedST run with every message that crossed the grid recorded."""
    cfg = experiment(tiny_root)
    run_dir = tmp_path_factory.mktemp("runs") / "fedst"
    messages: list[tuple[str, Message]] = []
    original = InProcessGrid.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs, observer=lambda d, m: messages.append((d, m)))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InProcessGrid, "__init__", recording_init)
        final = run_training(cfg, run_dir, progress=False)
    return cfg, run_dir, final, messages


def test_a_two_round_federation_writes_every_output(fedst_run):
    _, run_dir, final, _ = fedst_run
    for name in (
        "config.yaml",
        "config.json",
        "metrics.jsonl",
        "train.jsonl",
        "comm.jsonl",
        "final.json",
        "checkpoints/server.pt",
        "plots/learning_curves.png",
        "plots/communication.png",
        "plots/qualitative.png",
    ):
        assert (run_dir / name).is_file(), name
    assert sorted(final["sites"]) == ["A", "B", "C", "D"]
    assert sorted(final["out_of_federation"]) == ["E", "grasp"]
    assert list((run_dir / "tables").glob("*.md")) and list((run_dir / "tables").glob("*.csv"))
    rounds = {(r["round"], r["site"]) for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert rounds == {(t, s) for t in (1, 2) for s in "ABCD"}
    for site in "ABCD":
        assert (run_dir / "sites" / site / "state_r0002.pt").is_file()
    assert all(math.isfinite(v["dice"]) for v in final["sites"].values())


def test_only_shared_parameters_ever_leave_a_site(fedst_run):
    cfg, _, _, messages = fedst_run
    partition = partition_of(build_model(cfg), cfg)
    shared, personal = set(partition.shared), set(partition.personal)
    assert personal, "FedST must keep something private"
    uploads = [m for d, m in messages if d == "up"]
    assert len(uploads) == 2 * 4 * 2  # train + evaluate replies, 4 sites, 2 rounds
    for reply in uploads:
        for record in reply.content.array_records.values():
            assert set(record.keys()) <= shared
            assert not set(record.keys()) & personal
        for record in reply.content.config_records.values():
            assert set(record.keys()) == {"site"}  # no file names, ids or images travel
    downloads = [m for d, m in messages if d == "down"]
    for message in downloads:
        keys = set(message.content["arrays"].keys())
        if message.metadata.group_id == "1" and message.metadata.message_type == "train":
            assert keys == shared | personal  # the server's own initial model v_g^0, once
        else:
            assert keys == shared


def test_no_image_or_mask_data_crosses_the_grid(fedst_run):
    cfg, _, _, messages = fedst_run
    height, width = cfg.clip.image_size
    model_keys = set(build_model(cfg).state_dict())
    for _, message in messages:
        for record in message.content.array_records.values():
            assert set(record.keys()) <= model_keys
            for array in record.values():
                assert tuple(array.shape[-2:]) != (height, width)


def test_site_state_persists_in_context_and_on_disk(fedst_run):
    cfg, run_dir, _, _ = fedst_run
    state = torch.load(run_dir / "sites" / "A" / "state_r0002.pt", weights_only=False)
    partition = partition_of(build_model(cfg), cfg)
    assert set(state["personal"]) == set(partition.personal)
    assert state["round"] == 2 and state["num_examples"] > 0


def test_fedst_uploads_less_than_fedavg_would(fedst_run):
    cfg, _, final, _ = fedst_run
    model = build_model(cfg)
    whole = sum(
        v.numel() * v.element_size() for v in model.state_dict().values() if v.is_floating_point()
    )
    assert 0 < final["upload_mb_per_round"] * 1e6 < whole


# -- aggregation arithmetic -------------------------------------------------------------------


def reply(values: dict[str, np.ndarray], num_examples: int) -> Message:
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: torch.tensor(v) for k, v in values.items()}),
            "metrics": MetricRecord({"num-examples": num_examples}),
            "site": ConfigRecord({"site": "X"}),
        }
    )
    InProcessGrid(client_app, [])  # sets Flower's task identity for building messages
    instruction = Message(RecordDict(), dst_node_id=1, message_type="train", group_id="1")
    instruction.metadata.__dict__["_message_id"] = "m"
    return Message(content, reply_to=instruction)


def test_fedavg_is_the_sample_count_weighted_mean():
    replies = [reply({"w": np.array([0.0, 4.0])}, 1), reply({"w": np.array([3.0, 8.0])}, 3)]
    arrays, _ = FedAvg().aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [(0 * 1 + 3 * 3) / 4, (4 * 1 + 8 * 3) / 4])


def test_fedmedian_is_the_coordinate_wise_median_ignoring_weights():
    replies = [
        reply({"w": np.array([1.0, 9.0])}, 100),
        reply({"w": np.array([2.0, 0.0])}, 1),
        reply({"w": np.array([7.0, 5.0])}, 1),
    ]
    arrays, _ = FedMedian().aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [2.0, 5.0])


def test_the_server_step_leaves_the_servers_private_parameters_alone(tiny_root, tmp_path):
    cfg = experiment(tiny_root, "method.serq=false")
    server = FederationServer(cfg, tmp_path, torch.device("cpu"))
    before = {k: v.clone() for k, v in server.global_model.state_dict().items()}
    aggregated = {k: torch.full_like(before[k], 0.5) for k in server.partition.shared}
    server.server_step(aggregated, server_round=1)
    after = server.global_model.state_dict()
    for key in server.partition.personal:
        assert torch.equal(after[key], before[key]), key
    for key in server.partition.shared:
        assert torch.all(after[key] == 0.5), key


def test_integer_buffers_are_never_shared(tiny_root):
    cfg = experiment(tiny_root)
    model = build_model(cfg)
    partition = partition_of(model, cfg)
    state = model.state_dict()
    assert all(state[k].is_floating_point() for k in partition.shared)


# -- SERQ ---------------------------------------------------------------------------------


@pytest.fixture
def serq_server(tiny_root, tmp_path):
    cfg = experiment(tiny_root, "serq.batches_per_round=1", "augment.enabled=false")
    return FederationServer(cfg, tmp_path, torch.device("cpu"))


def eq_objective(serq, global_model, batch) -> float:
    images, masks, ids = batch
    with torch.no_grad():
        bank = torch.stack([serq.feature_bank[i] for i in ids]).float()
        logits, feat = serq._forward(serq.synthetic_model, images)
        gap = (feat - serq.domain_descriptor - bank).pow(2).mean()
        return (serq.loss_fn(logits, masks) + serq.cfg.lambda_eq * gap).item()


def sc_objective(serq, global_model, batch) -> float:
    images, masks, _ = batch
    with torch.no_grad():
        _, feat_syn = serq._forward(serq.synthetic_model, images)
        logits, feat = serq._forward(global_model, images)
        gap = (feat - (feat_syn - serq.domain_descriptor)).pow(2).mean()
        return (serq.loss_fn(logits, masks) + serq.cfg.lambda_sc * gap).item()


def test_serq_eq_step_lowers_its_objective_on_a_fixed_batch(serq_server):
    serq, global_model = serq_server.serq, serq_server.global_model
    batch = serq.stream.next_batch()
    serq.update_feature_bank(global_model, batch[0], batch[2])
    serq.synthetic_model.eval()
    global_model.eval()
    before = eq_objective(serq, global_model, batch)
    for _ in range(4):
        serq.explicit_quantification(global_model, [batch])
    serq.synthetic_model.eval()
    assert eq_objective(serq, global_model, batch) < before


def test_serq_sc_step_lowers_its_objective_on_a_fixed_batch(serq_server):
    serq, global_model = serq_server.serq, serq_server.global_model
    batch = serq.stream.next_batch()
    global_model.eval()
    before = sc_objective(serq, global_model, batch)
    for _ in range(4):
        serq.synchronize_convergence(global_model, [batch])
    global_model.eval()
    assert sc_objective(serq, global_model, batch) < before


def test_serq_eq_step_leaves_the_global_model_fixed_and_sc_leaves_v_pre_fixed(serq_server):
    serq, global_model = serq_server.serq, serq_server.global_model
    batch = serq.stream.next_batch()
    global_before = {k: v.clone() for k, v in global_model.state_dict().items()}
    serq.explicit_quantification(global_model, [batch])
    assert all(torch.equal(global_model.state_dict()[k], v) for k, v in global_before.items())
    pre_before = {k: v.clone() for k, v in serq.synthetic_model.state_dict().items()}
    descriptor = serq.domain_descriptor.detach().clone()
    serq.synchronize_convergence(global_model, [batch])
    assert all(torch.equal(serq.synthetic_model.state_dict()[k], v) for k, v in pre_before.items())
    assert torch.equal(serq.domain_descriptor.detach(), descriptor)


# -- resume and the NaN guard -----------------------------------------------------------------


def test_a_resumed_run_ends_with_the_same_metrics_as_an_uninterrupted_one(tiny_root, tmp_path):
    cfg = experiment(tiny_root, "serq.pretrain_iters=1", "train.eval_every=2")
    uninterrupted = run_training(cfg, tmp_path / "whole", progress=False)

    calls = {"n": 0}
    original = site_module.Site.train_round

    def crash_in_round_two(self, received, server_round, local_iters):
        if server_round == 2:
            calls["n"] += 1
            if calls["n"] == 3:  # two sites of round 2 have trained and saved; the third dies
                raise RuntimeError("power cut")
        return original(self, received, server_round, local_iters)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(site_module.Site, "train_round", crash_in_round_two)
        with pytest.raises(server_app.FederationError, match="power cut"):
            run_training(cfg, tmp_path / "resumed", progress=False)
    resumed = run_training(cfg, tmp_path / "resumed", progress=False)
    assert resumed["sites"] == uninterrupted["sites"]
    assert resumed["out_of_federation"] == uninterrupted["out_of_federation"]
    rounds = [
        r["round"] for r in read_jsonl(tmp_path / "resumed" / "train.jsonl") if r["site"] == "A"
    ]
    assert rounds == [1, 2]  # the interrupted round is logged once


def test_a_nan_loss_stops_the_run_with_a_clear_message_and_keeps_the_last_checkpoint(
    tiny_root, tmp_path
):
    cfg = experiment(tiny_root, "method.serq=false")
    from fedst.model import losses

    original = losses.SegmentationLoss.forward

    def nan_in_round_two(self, logits, target):
        value = original(self, logits, target)
        return (
            value * float("nan")
            if torch.is_grad_enabled() and nan_in_round_two.round == 2
            else value
        )

    nan_in_round_two.round = 0
    original_train = site_module.Site.train_round

    def tracking(self, received, server_round, local_iters):
        nan_in_round_two.round = server_round
        return original_train(self, received, server_round, local_iters)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(losses.SegmentationLoss, "forward", nan_in_round_two)
        patch.setattr(site_module.Site, "train_round", tracking)
        with pytest.raises(server_app.FederationError, match="loss is nan"):
            run_training(cfg, tmp_path / "run", progress=False)
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "server.pt", weights_only=False)
    assert checkpoint["round"] == 1


# -- the real entry points ----------------------------------------------------------------------


def test_train_fed_and_eval_outfed_run_from_the_command_line(tiny_root, tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "HF_HUB_OFFLINE": "1"}

    def run(script: str, *args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, script, *args, "progress=false"]
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    run_dir = tmp_path / "cli_run"
    train = run(
        "train_fed.py",
        "experiment=tiny",
        f"data.root={tiny_root}",
        "method=fedavg",
        f"hydra.run.dir={run_dir}",
    )
    assert "| fedavg |" in train.stdout and (run_dir / "final.json").is_file()
    evaluate = run("eval_outfed.py", f"run={run_dir}", "sites=[E]")
    assert evaluate.stdout.startswith("E: Dice") and (run_dir / "outfed_E.json").is_file()
