"""What travels, in how many bytes, and under which protection (issue 13): partial aggregation by
component, transport precision, differential privacy with Flower's wrappers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedst.app import server_app
from fedst.app.inprocess import InProcessGrid
from fedst.app.messaging import FederationError
from fedst.cli import compose_experiment
from fedst.data.procedural import generate
from fedst.federation import transport
from fedst.methods import method_of
from fedst.runs.layout import SERVER_CHECKPOINT
from fedst.training import run_training
from tests.conftest import reply_of_one_site, sent_keys, site_record, stand_in_reply


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def tiny(root: Path, *overrides: str):
    cfg, _ = compose_experiment(["experiment=tiny", f"data.root={root}", *overrides])
    return cfg


# -- partial aggregation by component ---------------------------------------------------------


def test_a_component_kept_local_never_leaves_a_site(tiny_root, tmp_path, monkeypatch):
    """FedAvg sharing only the encoder: decoder and head stay at the sites like rho."""
    cfg = tiny(tiny_root, "method=fedavg", "method.shared_components=[encoder]")
    messages: list[tuple[str, Message]] = []
    original_init = InProcessGrid.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs, observer=lambda d, m: messages.append((d, m)))

    monkeypatch.setattr(InProcessGrid, "__init__", recording_init)
    run_training(cfg, tmp_path / "run", progress=False)

    decoder_keys = {
        k for k in method_of(cfg).build_model().state_dict() if k.startswith("decoder.")
    }
    assert decoder_keys and any(k.startswith("decoder.head.") for k in decoder_keys)
    uploads = [m for d, m in messages if d == "up" and m.content.array_records]
    assert uploads
    for message in uploads:
        keys = sent_keys(message)
        assert keys and all(k.startswith("encoder.") for k in keys)
    for direction, message in messages:
        if direction == "down" and message.metadata.group_id != "1":
            assert not sent_keys(message) & decoder_keys
    state = method_of(cfg).build_model().state_dict()
    encoder_bytes = sum(4 * v.numel() for k, v in state.items() if k.startswith("encoder."))
    for row in map(json.loads, (tmp_path / "run" / "comm.jsonl").read_text().splitlines()):
        assert row["upload_param_bytes_by_component"] == {"encoder": encoder_bytes}


# -- transport precision ----------------------------------------------------------------------


@pytest.mark.parametrize(("precision", "unit_roundoff"), [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_half_precision_round_trips_within_the_casts_tolerance(precision, unit_roundoff):
    state = {"w": torch.randn(1000, generator=torch.Generator().manual_seed(0)), "b": torch.ones(3)}
    packed = transport.pack(state, precision)
    assert packed.param_bytes == 2 * 1003  # 2 bytes per value
    assert sum(a.numpy().nbytes for a in packed.buffers.values()) == 2 * 1003
    back = transport.unpack(RecordDict(packed.records()))
    assert list(back) == ["w", "b"] and back["w"].dtype == torch.float32
    relative = ((back["w"] - state["w"]).abs() / state["w"].abs()).max().item()
    assert 0 < relative <= unit_roundoff  # rounded, by at most half a unit in the last place
    assert torch.equal(back["b"], state["b"])


def constant_sites(values: dict[int, float], shared: tuple[str, ...], initial, precision: str):
    """A ClientApp stand-in: node k replies with the constant values[k] in every shared tensor,
    sent in ``precision``; equal weights."""

    def reply(message: Message, context) -> Message:
        node = message.metadata.dst_node_id
        content = {"site": site_record("ABCD"[node - 1], message, data_size=1)}
        metrics: dict = {"num-examples": 1, "uniform-weight": 1}
        if message.metadata.message_type == MessageType.TRAIN:
            gamma = {k: torch.full_like(initial[k], values[node]) for k in shared}
            content.update(transport.pack(gamma, precision).records())
        return stand_in_reply(message, content, metrics)

    return reply


def federate_constant_sites(root: Path, run_dir: Path, precision: str, rounds: int):
    """FedAvg of two stand-in sites A and B that send 1 and 1 + 2^-10 in every shared
    value for ``rounds`` rounds; returns the shared keys and the initial state."""
    cfg = tiny(
        root,
        "method=fedavg",
        f"comm.precision={precision}",
        "data.federation=[A,B]",
        f"train.total_iters={2 * rounds}",
        "method.synthetic_pretraining=false",
    )
    model = method_of(cfg).build_model()
    shared = method_of(cfg).partition(model).shared
    state = model.state_dict()
    sites = constant_sites({1: 1.0, 2: 1.0 + 2.0**-10}, shared, state, precision)
    server_app.run_federation(InProcessGrid(sites, [{}, {}]), cfg, run_dir, progress=False)
    return shared, state


def test_a_reply_in_the_older_per_tensor_layout_is_refused_with_one_line(tiny_root, tmp_path):
    """Site B answers like a FedST before issue 23 (one Array per tensor, no manifest): the
    server leaves it out as a failed site, and with every site required stops with that line."""
    cfg = tiny(tiny_root, "method=fedavg", "data.federation=[A,B]", "train.total_iters=2")
    model = method_of(cfg).build_model()
    shared, state = method_of(cfg).partition(model).shared, model.state_dict()
    current = constant_sites({1: 1.0, 2: 1.0}, shared, state, "fp32")

    def older_b(message: Message, context) -> Message:
        reply = current(message, context)
        if message.metadata.dst_node_id == 2 and "arrays" in reply.content:
            reply.content = RecordDict(
                {
                    "arrays": ArrayRecord({k: state[k] for k in shared}),
                    "metrics": reply.content["metrics"],
                    "site": reply.content["site"],
                }
            )
        return reply

    with pytest.raises(FederationError) as caught:
        server_app.run_federation(InProcessGrid(older_b, [{}, {}]), cfg, tmp_path, progress=False)
    (line,) = str(caught.value).splitlines()  # one line: the entry point prints it as it is
    assert f"B: reply refused (wire check): record 'arrays' carries {len(shared)} arrays" in line
    assert "older layout" in line and "same FedST version" in line


def test_the_server_averages_fp16_replies_in_fp32(tiny_root, tmp_path):
    """Sites send 1 and 1 + 2^-10 (both exact in fp16); their mean 1 + 2^-11 is exact in fp32 but
    not representable in fp16 (spacing 2^-10 at 1), so it survives only an fp32 aggregation."""
    shared, _ = federate_constant_sites(tiny_root, tmp_path, "fp16", rounds=1)
    global_model = torch.load(tmp_path / SERVER_CHECKPOINT, weights_only=False)["global_model"]
    for key in shared:
        assert global_model[key].dtype == torch.float32
        assert torch.all(global_model[key] == 1.0 + 2.0**-11), key


def test_each_sites_update_norm_is_logged_against_what_it_received(tiny_root, tmp_path):
    """Round 2: both sites received the round-1 mean 1 + 2^-11 in every shared float value and sent
    back 1 and 1 + 2^-10, so each update has norm 2^-11 * sqrt(N), N the shared float values."""
    shared, state = federate_constant_sites(tiny_root, tmp_path, "fp32", rounds=2)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    second = {
        r["site"]: r["update_norm"] for r in rows if r["round"] == 2 and r["site"] != "server"
    }
    values = sum(state[k].numel() for k in shared if state[k].is_floating_point())
    assert second == pytest.approx(dict.fromkeys("AB", 2.0**-11 * math.sqrt(values)), rel=1e-6)


# -- differential privacy -----------------------------------------------------------------------


def site_reply(update: np.ndarray) -> Message:
    """A train reply whose one shared tensor "w" is ``update`` (the sites received zeros)."""
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": torch.tensor(update, dtype=torch.float32)}),
            "metrics": MetricRecord({"num-examples": 1, "uniform-weight": 1}),
            "site": ConfigRecord({"site": "X"}),
        }
    )
    InProcessGrid(lambda m, c: m, [])  # Flower's task identity for building messages
    instruction = Message(RecordDict(), dst_node_id=1, message_type="train", group_id="1")
    instruction.metadata.__dict__["_message_id"] = "m"
    return Message(content, reply_to=instruction)


def dp_aggregate(noise_multiplier: float, updates: list[np.ndarray]) -> np.ndarray:
    cfg, _ = compose_experiment(
        [
            "experiment=tiny",
            "privacy.dp=server_fixed",
            "privacy.clipping_norm=1.0",
            f"privacy.noise_multiplier={noise_multiplier}",
        ]
    )
    replies = [site_reply(u) for u in updates]
    current = {"w": torch.zeros(updates[0].shape)}
    return method_of(cfg).aggregate(1, replies, current)["w"].numpy()


def test_server_side_clipping_bounds_every_update_by_the_clipping_norm():
    """Updates of norm 10, 0.5 and 4 against a bound of 1, no noise: the mean of u_k * min(1,
    1 / ||u_k||), computed by hand."""
    direction = np.ones(16) / 4.0  # unit norm
    updates = [10 * direction, 0.5 * direction, -4 * direction, 0.25 * direction]
    expected = (1.0 + 0.5 - 1.0 + 0.25) / 4 * direction
    np.testing.assert_allclose(dp_aggregate(0.0, updates), expected, rtol=1e-6, atol=1e-7)


def test_server_side_dp_adds_gaussian_noise_of_the_calibrated_std():
    """std = noise_multiplier * clipping_norm / K (Flower's calibration): sigma 2, bound 1, 4 sites
    -> 0.5, measured over 20,000 coordinates with a fixed seed."""
    np.random.seed(0)
    small = np.full(20_000, 1e-4, dtype=np.float32)  # norm 0.014, inside the bound
    noise = dp_aggregate(2.0, [small] * 4) - small
    assert abs(noise.mean()) < 0.02
    assert noise.std() == pytest.approx(0.5, rel=0.03)


def test_client_side_clipping_bounds_the_update_a_site_sends(tiny_root, tmp_path):
    """Site A trains a round under client-side fixed clipping (Flower's fixedclipping_mod): the
    L2 norm of what it sends minus what it received is at most the bound; without DP it is not."""
    norms = {}
    for mode in ("none", "client_fixed"):
        cfg = tiny(tiny_root, "method=fedavg", f"privacy.dp={mode}", "privacy.clipping_norm=0.01")
        model = method_of(cfg).build_model()
        sent = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
        config = {"server-round": 1, "local-iters": 2, "clipping_norm": 0.01}
        reply = reply_of_one_site(cfg, tmp_path / mode, MessageType.TRAIN, sent, **config)
        assert not reply.has_error(), reply.error.reason
        back = transport.unpack(reply.content)
        squares = sum(((back[k] - sent[k]) ** 2).sum().item() for k in back)
        norms[mode] = math.sqrt(squares)
    assert norms["client_fixed"] <= 0.01 * (1 + 1e-5)
    assert norms["none"] > 0.05  # the bound was active


def test_dp_is_refused_where_its_noise_would_not_mean_what_it_says():
    from fedst.config import ConfigError

    with pytest.raises(ConfigError, match="aggregation"):
        compose_experiment(["privacy.dp=server_fixed", "method.aggregation=fedmedian"])
    with pytest.raises(ConfigError, match="precision"):
        compose_experiment(["privacy.dp=client_fixed", "comm.precision=fp16"])


def test_the_adaptive_clipping_bound_moves_and_survives_a_server_restart():
    """Server-side adaptive clipping: when no update is clipped (fewer than the target half) the
    bound must come down, by exp(-lr * target) = exp(-0.2 * 0.5) without count noise (Andrew et
    al.'s geometric update); the bound is part of the server checkpoint (Method.state_dict)."""
    cfg, _ = compose_experiment(
        ["experiment=tiny", "privacy.dp=server_adaptive", "privacy.noise_multiplier=0"]
    )
    method = method_of(cfg)
    method.strategy.clipped_count_stddev = 0.0  # the count's noise off: the step is exact
    small = np.full(16, 1e-3, dtype=np.float32)
    method.aggregate(1, [site_reply(small) for _ in range(4)], {"w": torch.zeros(16)})
    bound = method.state_dict()["clipping_norm"]
    assert bound == pytest.approx(cfg.privacy.clipping_norm * math.exp(-0.2 * 0.5))
    restarted = method_of(cfg)
    restarted.load_state_dict(method.state_dict())
    assert restarted.strategy.clipping_norm == bound
