"""Specifications of the federation: Flower apps, privacy, aggregation, SERQ, resume, NaN guard.

Every end-to-end test runs the real entry-point path (Hydra config -> run_training ->
ServerApp/ClientApp over the in-process Grid) on the tiny procedural preset.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from hydra import compose, initialize_config_dir

from fedst.app import server_app
from fedst.app.inprocess import InProcessGrid
from fedst.app.keys import QUERY_SITE_STATS
from fedst.app.messaging import FederationError
from fedst.cli import check_method, register_resolvers, split_config
from fedst.data.procedural import generate
from fedst.experiment import ExperimentConfig
from fedst.federation import server as server_module
from fedst.federation import site as site_module
from fedst.federation import transport
from fedst.federation.server import FederationServer
from fedst.federation.site import Site
from fedst.federation.state_writer import wait_for_state_writes
from fedst.methods import Method, method_of
from fedst.methods.feature_bank import SERQ_BANK_SCRATCH
from fedst.model.state import state_subset
from fedst.scoring.site_data import open_site_data
from fedst.training import run_training
from tests.conftest import REPO, run_command, sent_keys, site_record


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def experiment(root: Path, *overrides: str) -> ExperimentConfig:
    register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=tiny", f"data.root={root}", *overrides])
    config = split_config(cfg)[0]
    check_method(config)  # as train_fed.py, right after the config parses
    return config


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- one tiny federation, inspected from every side ------------------------------------------------


INTEGER_BUFFER = "site_counter"
"""An int64 buffer the fixture's models carry (FedSTNet has none): it must never travel."""


def site_counter(index: int) -> int:
    return 100 + index


@dataclass
class SiteRound:
    """What one site's live model held right after its local training of one round."""

    personal: dict[str, torch.Tensor]
    counter: torch.Tensor


@pytest.fixture(scope="module")
def after_training() -> dict[tuple[str, int], SiteRound]:
    """(site, round) -> the site's live private tensors and buffer after its local training in
    ``fedst_run`` (filled by that fixture)."""
    return {}


@pytest.fixture(scope="module")
def fedst_run(
    tiny_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
    after_training: dict[tuple[str, int], SiteRound],
):
    """A 2-round FedST run (SERQ on) with every message that crossed the grid recorded.

    Every party's model also carries an int64 buffer (INTEGER_BUFFER): 0 at the server,
    ``site_counter(index)`` at each site.
    """
    cfg = experiment(tiny_root, "train.keep_resume_state=true")  # v_g too: its buffer is read
    run_dir = tmp_path_factory.mktemp("runs") / "fedst"
    messages: list[tuple[str, Message]] = []
    original_grid_init = InProcessGrid.__init__
    original_site_init = site_module.Site.__init__
    original_train_round = site_module.Site.train_round
    original_build_model = Method.build_model

    def recording_init(self, *args, **kwargs):
        original_grid_init(self, *args, **kwargs, observer=lambda d, m: messages.append((d, m)))

    def with_integer_buffer(method):
        model = original_build_model(method)
        model.register_buffer(INTEGER_BUFFER, torch.zeros(3, dtype=torch.int64))
        return model

    def site_init(self, *args, **kwargs):
        original_site_init(self, *args, **kwargs)
        getattr(self.model, INTEGER_BUFFER).fill_(site_counter(self.index))

    def recording_train_round(self, received, server_round, local_iters, **kwargs):
        result = original_train_round(self, received, server_round, local_iters, **kwargs)
        after_training[(self.name, server_round)] = SiteRound(
            personal=state_subset(self.model, self.partition.personal),
            counter=getattr(self.model, INTEGER_BUFFER).clone(),
        )
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InProcessGrid, "__init__", recording_init)
        patch.setattr(Method, "build_model", with_integer_buffer)
        patch.setattr(site_module.Site, "__init__", site_init)
        patch.setattr(site_module.Site, "train_round", recording_train_round)
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
        "plots/serq.png",  # SERQ is on: D_sy, feature RMS, losses and server pull over rounds
    ):
        assert (run_dir / name).is_file(), name
    assert sorted(final["sites"]) == ["A", "B", "C", "D"]
    assert sorted(final["out_of_federation"]) == ["E", "grasp"]
    assert re.fullmatch(r"[0-9a-f]{40}", final["code"]["commit"])  # the tests run in a checkout
    assert list((run_dir / "tables").glob("*.md")) and list((run_dir / "tables").glob("*.csv"))
    rounds = {(r["round"], r["site"]) for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert rounds == {(t, s) for t in (1, 2) for s in "ABCD"}
    for site in "ABCD":
        assert (run_dir / "sites" / site / "state_r0002.pt").is_file()
    assert all(math.isfinite(v["dice"]) for v in final["sites"].values())


def test_only_shared_parameters_ever_leave_a_site(fedst_run):
    cfg, _, _, messages = fedst_run
    partition = method_of(cfg).partition(method_of(cfg).build_model())
    shared, personal = set(partition.shared), set(partition.personal)
    assert personal, "FedST must keep something private"
    uploads = [m for d, m in messages if d == "up"]
    # train + evaluate replies, 4 sites, 2 rounds; one statistics reply per site (numbers only)
    assert len(uploads) == 2 * 4 * 2 + 4
    for reply in uploads:
        for keys in transport.describe(reply.content).values():  # from the manifests
            assert set(keys) <= shared
            assert not set(keys) & personal
        for name, record in reply.content.config_records.items():
            if name.endswith(transport.MANIFEST_SUFFIX):
                assert set(record.keys()) == {"version", "tensors"}
            else:  # no file names, ids or images travel: the site, its round, its data size
                answer = {"site", "round"}
                if reply.metadata.message_type == "train":
                    answer |= {"data-size", "data-changed"}
                assert set(record.keys()) == answer
    downloads = [m for d, m in messages if d == "down"]
    for message in downloads:
        keys = sent_keys(message)
        if message.metadata.group_id == "1" and message.metadata.message_type == "train":
            assert keys == shared | personal  # the server's own initial model v_g^0, once
        elif message.metadata.message_type == QUERY_SITE_STATS:
            assert keys == set()  # the statistics query carries no parameter
        else:
            assert keys == shared


def test_no_image_or_mask_data_crosses_the_grid(fedst_run):
    cfg, _, _, messages = fedst_run
    height, width = cfg.clip.image_size
    model_keys = set(method_of(cfg).build_model().state_dict())
    for _, message in messages:
        for shapes in transport.describe(message.content).values():  # from the manifests
            assert set(shapes) <= model_keys
            for shape in shapes.values():
                assert tuple(shape[-2:]) != (height, width)
        for record in message.content.array_records.values():  # the buffers: 1-D
            assert all(len(array.shape) == 1 for array in record.values())


def test_each_sites_private_state_after_a_round_is_on_its_disk(fedst_run, after_training):
    cfg, run_dir, _, _ = fedst_run
    personal = set(method_of(cfg).partition(method_of(cfg).build_model()).personal)
    for site in cfg.data.federation:
        state = torch.load(run_dir / "sites" / site / "state_r0002.pt", weights_only=False)
        assert state["round"] == 2 and state["site"] == site
        assert set(state["personal"]) == personal
        live = after_training[(site, 2)].personal
        for key in personal:
            assert torch.equal(state["personal"][key], live[key]), (site, key)
    a, b = (after_training[(s, 2)].personal for s in cfg.data.federation[:2])
    assert any(not torch.equal(a[k], b[k]) for k in personal)  # each site saved its own rho_k


def test_every_site_reports_its_number_of_training_samples_as_num_examples(fedst_run):
    cfg, _, _, messages = fedst_run
    train_sizes = {s: len(open_site_data(cfg, s, ("train",)).train) for s in cfg.data.federation}
    assert len(set(train_sizes.values())) > 1  # otherwise any constant weight would pass
    replies = [m for d, m in messages if d == "up" and m.metadata.message_type == "train"]
    assert len(replies) == 2 * len(train_sizes)
    for reply in replies:
        site = reply.content["site"]["site"]
        weight = reply.content["metrics"]["num-examples"]  # n_k, FedAvg's sample weight
        assert isinstance(weight, int) and weight == train_sizes[site], site


def test_fedst_uploads_exactly_what_fedavg_would_minus_the_personalized_tensors(
    fedst_run, tiny_root
):
    cfg, run_dir, final, messages = fedst_run
    model = method_of(cfg).build_model()
    state = model.state_dict()
    # What method=fedavg's partition sends for the same network: every float tensor.
    fedavg_upload = set(method_of(experiment(tiny_root, "method=fedavg")).partition(model).shared)
    assert fedavg_upload == {k for k, v in state.items() if v.is_floating_point()}
    personal = set(method_of(cfg).partition(model).personal)
    uploads = [m for d, m in messages if d == "up" and m.metadata.message_type == "train"]
    for reply in uploads:
        sent = sent_keys(reply)
        assert sent < fedavg_upload and fedavg_upload - sent == personal
    saved = sum(state[k].numel() * 4 for k in personal)  # fp32: 4 bytes per value
    fedavg_bytes = sum(state[k].numel() * 4 for k in fedavg_upload)
    comm = read_jsonl(run_dir / "comm.jsonl")
    assert {row["upload_param_bytes"] for row in comm} == {fedavg_bytes - saved}
    assert final["upload_mb_per_round"] == pytest.approx((fedavg_bytes - saved) / 1e6)


def test_an_integer_buffer_never_travels_and_is_never_averaged(fedst_run, after_training):
    cfg, run_dir, _, messages = fedst_run
    for _, message in messages:
        for keys in transport.describe(message.content).values():
            assert INTEGER_BUFFER not in keys
    for (site, _), seen in after_training.items():
        index = cfg.data.federation.index(site)
        assert torch.equal(seen.counter, torch.full((3,), site_counter(index))), site
    server = torch.load(run_dir / "checkpoints" / "server.pt", weights_only=False)
    assert torch.equal(server["global_model"][INTEGER_BUFFER], torch.zeros(3, dtype=torch.int64))
    assert len(after_training) == 2 * len(cfg.data.federation)


# -- aggregation: our use of Flower's strategies ---------------------------------------------


@pytest.mark.parametrize(
    ("aggregation", "weights", "expected"),
    [
        ("fedavg", "samples", (0.0 * 1 + 1.0 * 2 + 2.0 * 3 + 7.0 * 4) / (1 + 2 + 3 + 4)),  # 3.6
        ("fedavg", "uniform", (0.0 + 1.0 + 2.0 + 7.0) / 4),  # Algorithm 1 line 8: 1/K, 2.5
        ("fedmedian", "uniform", (1.0 + 2.0) / 2),  # median of 0, 1, 2, 7; no weights
    ],
)
def test_the_server_aggregates_the_shared_tensors_the_sites_send(
    tiny_root, tmp_path, aggregation, weights, expected
):
    """Constructed site replies (site k sends the constant c_k in every shared tensor and
    num-examples n_k) through the real ServerApp loop; the server's v_g must hold the hand value:
    the sample-count weighted mean, the uniform 1/K mean of Algorithm 1 line 8, or the median.
    The encoder queries are kept private, so the server's own copies must stay untouched."""
    cfg = experiment(
        tiny_root,
        "method=fedavg",
        "method.personalization=encoder_query",
        "method.synthetic_pretraining=false",  # the server's v_g^0 is the initialisation
        "train.total_iters=2",
        f"method.aggregation={aggregation}",
        f"method.aggregation_weights={weights}",
    )
    model = method_of(cfg).build_model()
    initial, partition = model.state_dict(), method_of(cfg).partition(model)
    constant = {1: 0.0, 2: 1.0, 3: 2.0, 4: 7.0}  # node id -> c_k
    examples = {1: 1, 2: 2, 3: 3, 4: 4}  # node id -> n_k

    def constructed_site(message: Message, context) -> Message:
        node = message.metadata.dst_node_id
        metrics: dict = {"num-examples": examples[node], "uniform-weight": 1}
        content = {"site": site_record("ABCD"[node - 1], message, data_size=examples[node])}
        if message.metadata.message_type == MessageType.TRAIN:
            gamma = {k: torch.full_like(initial[k], constant[node]) for k in partition.shared}
            content.update(transport.pack(gamma, "fp32").records())
            metrics |= {"train-loss": 1.0, "seconds": 0.0}
        else:
            metrics |= {"dice": 0.5, "iou": 0.5, "hd95": 1.0, "assd": 1.0}
        content["metrics"] = MetricRecord(metrics)
        return Message(RecordDict(content), reply_to=message)

    grid = InProcessGrid(constructed_site, [{} for _ in cfg.data.federation])
    server_app.run_federation(grid, cfg, tmp_path, progress=False)
    global_model = torch.load(tmp_path / server_module.SERVER_CHECKPOINT, weights_only=False)[
        "global_model"
    ]
    for key in partition.shared:
        assert global_model[key].dtype == initial[key].dtype, key
        torch.testing.assert_close(global_model[key], torch.full_like(initial[key], expected))
    for key in partition.personal:  # the server's own rho_g: no site sent it
        assert torch.equal(global_model[key], initial[key]), key


# -- SERQ ---------------------------------------------------------------------------------


@pytest.fixture
def serq_server(tiny_root, tmp_path):
    cfg = experiment(tiny_root, "serq.batches_per_round=1", "augment.enabled=false")
    return FederationServer(cfg, tmp_path, torch.device("cpu"))


def test_the_server_step_never_reaches_a_sites_private_parameters(serq_server, tmp_path):
    """With SERQ on, SC (Eq. 12) trains all of v_g, the server's own rho_g included. What must
    hold (Algorithm 1): line 9, v_g = gamma_g^{t+1} U rho_g^t enters SERQ; line 12, only gamma_g
    is distributed; so a site's rho_k after the server step is the one it trained itself."""
    server, cpu = serq_server, torch.device("cpu")
    cfg = server.cfg
    shared, personal = server.partition.shared, server.partition.personal
    site_dir = tmp_path / "sites" / "A"
    gamma_a = Site("A", cfg, site_dir, cpu).train_round(server.initial_payload(), 1, 1).shared
    wait_for_state_writes(site_dir)  # the state file is written behind the round
    rho_a = torch.load(site_dir / "state_r0001.pt", weights_only=False)["personal"]
    rho_g = state_subset(server.global_model, personal)

    entering: dict[str, torch.Tensor] = {}
    original_step = server.step.serq.step

    def recording_step(global_model):
        entering.update(state_subset(global_model, [*shared, *personal]))
        return original_step(global_model)

    server.step.serq.step = recording_step
    server.server_step(gamma_a, server_round=1)  # the aggregate of a single site is its gamma
    for key in shared:
        assert torch.equal(entering[key], gamma_a[key]), key
    for key in personal:
        assert torch.equal(entering[key], rho_g[key]), key
    rho_g_after = state_subset(server.global_model, personal)
    assert any(not torch.equal(rho_g_after[k], rho_g[k]) for k in personal)  # SC trained rho_g

    payload = server.shared_payload()
    assert set(payload) == set(shared)
    restarted = Site("A", cfg, site_dir, cpu)  # a new process: state comes from A's disk
    restarted.train_round(payload, 2, local_iters=0)
    for key in personal:
        assert torch.equal(restarted.model.state_dict()[key], rho_a[key]), key
        assert not torch.equal(rho_a[key], rho_g_after[key]), key
    for key in shared:
        assert torch.equal(restarted.model.state_dict()[key], payload[key]), key


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
    serq, global_model = serq_server.step.serq, serq_server.global_model
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
    serq, global_model = serq_server.step.serq, serq_server.global_model
    batch = serq.stream.next_batch()
    global_model.eval()
    before = sc_objective(serq, global_model, batch)
    for _ in range(4):
        serq.synchronize_convergence(global_model, [batch])
    global_model.eval()
    assert sc_objective(serq, global_model, batch) < before


def test_serq_eq_step_leaves_the_global_model_fixed_and_sc_leaves_v_pre_fixed(serq_server):
    serq, global_model = serq_server.step.serq, serq_server.global_model
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


@contextmanager
def at_the_third_site_of(server_round: int, action: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``action()`` runs when the third site to train in ``server_round``
    starts: two sites of that round have trained and saved their states, the server has not."""
    original = site_module.Site.train_round
    trained: list[str] = []

    def train_round(self, received, round_now, local_iters, **kwargs):
        if round_now == server_round:
            trained.append(self.name)
            if len(trained) == 3:
                action()
        return original(self, received, round_now, local_iters, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(site_module.Site, "train_round", train_round)
        yield


def run_cut_off(cfg: ExperimentConfig, run_dir: Path, server_round: int) -> None:
    """Run ``cfg`` until the third site to train in ``server_round`` dies ("power cut"): two
    sites of that round have trained and saved their states, the server has not."""

    def power_cut() -> None:
        raise RuntimeError("power cut")

    cut = at_the_third_site_of(server_round, power_cut)
    with cut, pytest.raises(FederationError, match="power cut"):
        run_training(cfg, run_dir, progress=False)


def site_training_trace(run_dir: Path) -> dict[tuple[str, int], tuple[float, float]]:
    """(site, round) -> (mean training loss, update norm) of every site round in ``train.jsonl``:
    a function of the state each round starts from (weights, personal parameters, optimizer)."""
    rows = read_jsonl(run_dir / "train.jsonl")
    return {
        (r["site"], r["round"]): (r["loss"], r["update_norm"])
        for r in rows
        if r["site"] != "server" and "loss" in r
    }


def test_a_resumed_run_ends_with_the_same_metrics_as_an_uninterrupted_one(tiny_run, tmp_path):
    """The uninterrupted run is the session's tiny run (tests/conftest.py). Device: the tiny
    experiment's train.device=auto (CUDA where present) with its train.deterministic=true, so
    the equality holds bit for bit on the CPU and on one GPU."""
    cfg, run_dir, uninterrupted = tiny_run

    run_cut_off(cfg, tmp_path / "resumed", server_round=2)
    resumed = run_training(cfg, tmp_path / "resumed", progress=False)
    assert resumed["sites"] == uninterrupted["sites"]
    assert resumed["out_of_federation"] == uninterrupted["out_of_federation"]
    # the tiny run's scores can be 0 whatever the weights: the losses and update norms cannot
    assert site_training_trace(tmp_path / "resumed") == site_training_trace(run_dir)
    rounds = [
        r["round"] for r in read_jsonl(tmp_path / "resumed" / "train.jsonl") if r["site"] == "A"
    ]
    assert rounds == [1, 2]  # the interrupted round is logged once


def copy_when_cut_off(cfg: ExperimentConfig, run_dir: Path, server_round: int, copy: Path) -> dict:
    """Run ``cfg`` to its end, uninterrupted, and return its final.json; when the third site to
    train in ``server_round`` starts, copy ``run_dir`` to ``copy`` first (once the two sites'
    state writes are on disk): the files a power cut at that moment leaves. The run goes on as
    if nothing happened, so one training gives the uninterrupted reference and the cut-off run."""

    def copy_the_run() -> None:
        wait_for_state_writes(under=run_dir)
        shutil.copytree(run_dir, copy)

    with at_the_third_site_of(server_round, copy_the_run):
        final = run_training(cfg, run_dir, progress=False)
    assert copy.is_dir(), f"round {server_round} never reached its third site"
    return final


def test_a_run_checkpointed_every_3_rounds_resumes_after_its_last_checkpoint_as_if_uninterrupted(
    tiny_root, tmp_path
):
    """train.checkpoint_every=3 over 5 rounds: the server saves after rounds 3 and 5 only; a run
    cut off in round 5 (a power cut: its files as they were, :func:`copy_when_cut_off`; the
    test above resumes a run stopped by an error) restarts after round 3, whose states its
    sites kept although they had saved rounds 4 and 5 since, and ends with the uninterrupted
    run's metrics. SERQ's working bank is in its scratch file (serq.bank_storage=disk, as
    paper.yaml), refilled from round 3's bank. Device: train.device=auto (CUDA where present)
    with the tiny experiment's train.deterministic=true, so the equality holds bit for bit on
    the CPU and on one GPU."""
    cfg = experiment(
        tiny_root,
        "pretraining.iters=1",
        "train.total_iters=10",
        "train.checkpoint_every=3",
        "serq.bank_storage=disk",
    )
    crashed = tmp_path / "resumed"
    uninterrupted = copy_when_cut_off(cfg, tmp_path / "whole", 5, crashed)  # A, B saved round 5
    assert not (tmp_path / "whole" / SERQ_BANK_SCRATCH).exists()  # deleted at the end
    rows = read_jsonl(tmp_path / "whole" / "train.jsonl")
    server = [r for r in rows if r["site"] == "server" and r["round"] >= 1]
    saved = {r["round"]: r["checkpoint_bytes"] > 0 for r in server}
    assert saved == {1: False, 2: False, 3: True, 4: False, 5: True}

    assert torch.load(crashed / "checkpoints" / "server.pt", weights_only=False)["round"] == 3
    # A keeps round 3 (the server's checkpoint) beside its two latest; rounds 1-2 are gone
    states = sorted(p.name for p in (crashed / "sites" / "A").glob("state_r*.pt"))
    assert states == ["state_r0003.pt", "state_r0004.pt", "state_r0005.pt"]
    assert (crashed / SERQ_BANK_SCRATCH).exists()  # the cut-off server never closed it
    resumed = run_training(cfg, crashed, progress=False)
    assert resumed["sites"] == uninterrupted["sites"]
    assert resumed["out_of_federation"] == uninterrupted["out_of_federation"]
    assert site_training_trace(crashed) == site_training_trace(tmp_path / "whole")
    rounds = [r["round"] for r in read_jsonl(crashed / "train.jsonl") if r["site"] == "A"]
    assert rounds == [1, 2, 3, 4, 5]  # rounds 4 and 5 redone, each logged once


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

    def tracking(self, received, server_round, local_iters, **kwargs):
        nan_in_round_two.round = server_round
        return original_train(self, received, server_round, local_iters, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(losses.SegmentationLoss, "forward", nan_in_round_two)
        patch.setattr(site_module.Site, "train_round", tracking)
        with pytest.raises(FederationError, match="loss is nan"):
            run_training(cfg, tmp_path / "run", progress=False)
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "server.pt", weights_only=False)
    assert checkpoint["round"] == 1


# -- the real entry points ----------------------------------------------------------------------


def test_train_fed_and_eval_outfed_run_from_the_command_line(tiny_cli_run, tmp_path):
    """train_fed.py: the session's run from the command line (tests/conftest.py); eval_outfed.py
    on a copy of it, in a process of its own."""
    assert "| fedst |" in tiny_cli_run.stdout and (tiny_cli_run.run_dir / "final.json").is_file()
    run_dir = tmp_path / "cli_run"
    shutil.copytree(tiny_cli_run.run_dir, run_dir)
    evaluate = run_command(
        ["eval_outfed.py", f"run={run_dir}", "sites=[E]", "progress=false"], REPO
    )
    assert evaluate.returncode == 0, evaluate.stderr[-2000:]
    assert evaluate.stdout.startswith("E: Dice") and (run_dir / "outfed_E.json").is_file()
