"""Specifications of what a site receives and keeps (issues 9.3, 8.9, 10):

* a message carries the site view of the experiment: no data path of any site, nothing of the
  server's disk; each site's own settings come from its node config;
* private state lives on the site's disk with a fingerprint of the config that made it, not in
  Flower's ``context.state``; resuming with another config fails naming the key;
* a site that fails during a round is left out when enough others answered, and rejoins from
  its state on disk; a site may decline to send rho_k at the end and is left out of the
  out-of-federation average.

All in-process (fedst.app.inprocess), tiny preset.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from flwr.app import Message

from fedst.app import messaging, server_app
from fedst.app.client_app import app as client_app
from fedst.app.client_app import release_sites
from fedst.app.inprocess import InProcessGrid
from fedst.app.keys import QUERY_SITE_STATS
from fedst.app.messaging import FederationError
from fedst.app.nodes import site_node_config
from fedst.config import ConfigError
from fedst.data.procedural import generate
from fedst.deploy import run_config_overrides
from fedst.experiment import (
    DeployConfig,
    RoundPolicy,
    experiment_from_json,
    site_view,
    state_fingerprint,
)
from fedst.federation import site as site_module
from fedst.federation.site import (
    STATE_FINGERPRINT,
    NonFiniteLossError,
    Site,
    StateMismatchError,
)
from fedst.federation.state_writer import wait_for_state_writes
from fedst.methods import method_of
from fedst.runs import Run
from fedst.training import finalize_run, prepare_run, run_training
from tests.test_federation import experiment, read_jsonl


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


# -- what travels ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_round(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """A 1-round in-process FedST run with every message and the grid recorded."""
    cfg = experiment(tiny_root, "train.total_iters=2", "train.local_iters=2")
    run_dir = tmp_path_factory.mktemp("runs") / "one_round"
    messages: list[tuple[str, Message]] = []
    grids: list[InProcessGrid] = []
    original = InProcessGrid.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs, observer=lambda d, m: messages.append((d, m)))
        grids.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InProcessGrid, "__init__", recording_init)
        run_training(cfg, run_dir, progress=False)
    return cfg, run_dir, messages, grids[0]


def test_messages_carry_no_path_of_any_site_or_of_the_server(one_round, tiny_root):
    _cfg, run_dir, messages, _ = one_round
    downloads = [m for d, m in messages if d == "down"]
    assert downloads
    for message in downloads:
        config = dict(message.content["config"])
        # the statistics query before round 1 (fedst/app/site_statistics.py) keeps no round
        last = (
            "stats-sample-frames"
            if message.metadata.message_type == QUERY_SITE_STATS
            else "keep-rounds"
        )
        assert set(config) == {
            "experiment", "run-name", "local-iters", "server-round", last
        }  # fmt: skip
        text = json.dumps(config)
        assert str(tiny_root) not in text and str(run_dir) not in text
        assert str(tiny_root.parent) not in text and str(run_dir.parent) not in text
        view = experiment_from_json(config["experiment"])
        assert {spec.root for spec in view.data.sites.values()} == {""}
        assert all(spec.options == {} for spec in view.data.sites.values())
        assert view.data.root is None and config["run-name"] == run_dir.name
    # ... while every site still trained on its own data: the roots came from its node config
    assert {r["site"] for r in read_jsonl(run_dir / "train.jsonl")} >= set("ABCD")


def test_private_state_is_on_the_sites_disk_with_a_fingerprint_not_in_flower_context(one_round):
    cfg, run_dir, _, grid = one_round
    for node_id in grid.get_node_ids():
        assert len(grid.context_of(node_id).state) == 0
    expected = state_fingerprint(site_view(cfg))
    partition = method_of(cfg).partition(method_of(cfg).build_model())
    for site in "ABCD":
        folder = run_dir / "sites" / site
        assert json.loads((folder / STATE_FINGERPRINT).read_text())["fingerprint"] == expected
        state = torch.load(folder / "state_r0001.pt", weights_only=False)
        assert set(state["personal"]) == set(partition.personal)


# -- the state folder's fingerprint ----------------------------------------------------------


def test_a_site_refuses_a_state_folder_made_with_another_config(tiny_root, tmp_path):
    cfg = experiment(tiny_root)
    Site("A", cfg, tmp_path, torch.device("cpu"))
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=1.0))
    with pytest.raises(StateMismatchError, match=r"train\.lr=0\.0003->1\.0"):
        Site("A", other, tmp_path, torch.device("cpu"))


def test_a_site_accepts_its_state_folder_with_other_evaluation_settings_or_paths(
    tiny_root, tmp_path
):
    cfg = experiment(tiny_root)
    first = Site("A", cfg, tmp_path, torch.device("cpu"))
    same_training = experiment(tiny_root, "train.eval_every=7", "train.eval_max_frames=1")
    again = Site("A", same_training, tmp_path, torch.device("cpu"))  # no StateMismatchError
    assert again.fingerprint == first.fingerprint


# -- dropout and rejoin ----------------------------------------------------------------------


def test_a_site_that_missed_rounds_continues_from_its_saved_private_state(tiny_root, tmp_path):
    cfg = experiment(tiny_root)
    first = Site("A", cfg, tmp_path, torch.device("cpu"))
    full = {k: v.clone() for k, v in method_of(cfg).build_model().state_dict().items()}
    first.train_round(full, server_round=1, local_iters=1)
    wait_for_state_writes(tmp_path)  # the state is written in the background
    saved = torch.load(tmp_path / "state_r0001.pt", weights_only=False)["personal"]
    restarted = Site("A", cfg, tmp_path, torch.device("cpu"))  # a new process after a crash
    received = {k: torch.zeros_like(v) for k, v in full.items()}  # newcomer payload: full model
    restarted.train_round(received, server_round=3, local_iters=0)
    now = restarted.model.state_dict()
    for key, value in saved.items():
        assert torch.equal(now[key], value), key  # its own rho_k, not the received one
    shared = set(restarted.partition.shared)
    assert all(torch.count_nonzero(now[k]) == 0 for k in shared)  # gamma_g was taken
    wait_for_state_writes(tmp_path)
    assert (tmp_path / "state_r0003.pt").is_file()


def _inprocess_run(cfg, run_dir, policy, node_settings=None, node_sites=None):
    """run_federation over an InProcessGrid whose nodes keep their state outside the run dir
    (as hospitals do), then finalize as the deployed server does (no site data)."""
    prepare_run(cfg, run_dir)
    sites = node_sites or list(cfg.data.federation)
    nodes = [
        site_node_config(
            cfg,
            site,
            run_state_dir=str(run_dir.parent / f"{run_dir.name}_state_{i}_{site}"),
            **(node_settings or {}).get(site, {}),
        ).to_node_config()
        for i, site in enumerate(sites)
    ]
    grid = InProcessGrid(client_app, nodes)
    try:
        server_app.run_federation(grid, cfg, run_dir, progress=False, policy=policy)
    finally:
        release_sites()
    return grid


def test_a_non_finite_loss_stops_the_site_naming_its_iteration_before_anything_is_saved(
    tiny_root, tmp_path
):
    """Losses are read once per phase (no host sync per step): the check names the first
    non-finite iteration and the round's state is not written, so the last checkpoint is kept."""
    cfg = experiment(tiny_root)
    site = Site("A", cfg, tmp_path, torch.device("cpu"))
    assert [phase.iterations for phase in site.method.local_phases(3)] == [3]
    original, calls = site.method.local_loss, []

    def nan_at_the_second_step(owner, logits, masks):
        calls.append(1)
        loss = original(owner, logits, masks)
        return loss * float("nan") if len(calls) == 2 else loss

    site.method.local_loss = nan_at_the_second_step
    full = {k: v.clone() for k, v in method_of(cfg).build_model().state_dict().items()}
    with pytest.raises(NonFiniteLossError) as caught:
        site.train_round(full, server_round=1, local_iters=3)
    message = str(caught.value)
    assert "site A: loss is nan at round 1, local iteration 1 (" in message
    assert "keeps the checkpoint of round 0" in message and "train.max_grad_norm" in message
    assert len(calls) == 3  # the phase ran to its end; nothing was saved for round 1
    assert not (tmp_path / "state_r0001.pt").exists()


def test_a_sites_grad_scaler_is_saved_and_restored_with_its_state(tiny_root, tmp_path):
    """fp16 (CUDA) sites keep their loss scale across rounds and restarts; on the CPU the site
    has no scaler, so one is put in by hand."""
    cfg = experiment(tiny_root)
    first = Site("A", cfg, tmp_path, torch.device("cpu"))
    assert first.scaler is None  # fp32 on the CPU whatever train.amp_dtype says
    first.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    full = {k: v.clone() for k, v in method_of(cfg).build_model().state_dict().items()}
    first.train_round(full, server_round=1, local_iters=1)
    wait_for_state_writes(tmp_path)  # the state is written in the background
    saved = torch.load(tmp_path / "state_r0001.pt", weights_only=False)
    assert saved["scaler"]["scale"] == first.scaler.get_scale()
    restarted = Site("A", cfg, tmp_path, torch.device("cpu"))
    restarted.scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    restarted.restore(1)
    assert restarted.scaler.get_scale() == first.scaler.get_scale()


def test_a_round_goes_on_without_a_failing_site_which_rejoins_and_may_decline_export(
    tiny_root, tmp_path
):
    cfg = experiment(tiny_root, "train.total_iters=6", "data.out_of_federation=[E]")
    assert cfg.train.rounds == 3
    original = site_module.Site.train_round

    def d_fails_in_round_two(self, received, server_round, local_iters, **kwargs):
        if self.name == "D" and server_round == 2:
            raise ConnectionError("hospital D lost power")
        return original(self, received, server_round, local_iters, **kwargs)

    policy = RoundPolicy(min_sites=3, collect_personal=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(site_module.Site, "train_round", d_fails_in_round_two)
        _inprocess_run(
            cfg, tmp_path / "run", policy, node_settings={"C": {"share_personal": False}}
        )
    participation = read_jsonl(tmp_path / "run" / "participation.jsonl")
    assert [(r["round"], r["missing"]) for r in participation] == [(1, []), (2, ["D"]), (3, [])]
    train_d = [r["round"] for r in read_jsonl(tmp_path / "run" / "train.jsonl") if r["site"] == "D"]
    assert train_d == [1, 3]
    export = json.loads((tmp_path / "run" / "personal_export.json").read_text())
    assert export["shared"] == ["A", "B", "D"] and export["declined"] == ["C"]
    final = finalize_run(Run(tmp_path / "run", cfg), qualitative=0, site_data=False)
    assert final["out_of_federation_average"] == {
        "sites": ["A", "B", "D"],
        "left_out": ["C (declined)"],
    }
    assert "E" in final["out_of_federation"]


def test_evaluate_steps_wait_the_eval_timeout_and_training_steps_the_round_timeout(
    tiny_root, tmp_path
):
    """Scoring a whole split (HD95 / ASSD included) takes longer than E local iterations: test
    and validation broadcasts get policy.eval_timeout, training broadcasts policy.round_timeout."""
    cfg = experiment(
        tiny_root,
        "data.federation=[A,D]",
        "data.out_of_federation=[]",
        "train.total_iters=2",
        "train.local_iters=2",
        "train.val_every=1",
    )
    timeouts: list[tuple[str, str, float | None]] = []
    original = messaging.broadcast

    def recording(grid, nodes, kind, payload, config, server_round, timeout=None, **kwargs):
        timeouts.append((kind, config.get("split", "test"), timeout))
        return original(grid, nodes, kind, payload, config, server_round, timeout, **kwargs)

    policy = RoundPolicy(round_timeout=100.0, eval_timeout=300.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(messaging, "broadcast", recording)
        _inprocess_run(cfg, tmp_path / "run", policy)
    assert ("train", "test", 100.0) in timeouts
    evaluations = {(split, t) for kind, split, t in timeouts if kind == "evaluate"}
    assert evaluations == {("test", 300.0), ("val", 300.0)}
    assert all(t == 100.0 for kind, _, t in timeouts if kind != "evaluate")


def test_the_eval_timeout_defaults_to_three_round_timeouts_and_reaches_the_serverapp():
    assert DeployConfig(round_timeout=600.0).policy().eval_timeout == 1800.0
    assert DeployConfig(round_timeout=600.0, eval_timeout=50.0).policy().eval_timeout == 50.0
    overrides = run_config_overrides(Path("run"), DeployConfig(round_timeout=10.0))
    assert "round-timeout=10.0" in overrides.split() and "eval-timeout=0.0" in overrides.split()
    run_config = {k: json.loads(v) for k, v in (item.split("=") for item in overrides.split())}
    assert DeployConfig.from_run_config(run_config).policy().eval_timeout == 30.0
    with pytest.raises(ConfigError, match=r"deploy.eval_timeout=0: must be > 0"):
        DeployConfig(eval_timeout=0)


def test_a_round_with_fewer_sites_than_the_minimum_stops_naming_the_failure(tiny_root, tmp_path):
    cfg = experiment(tiny_root, "data.federation=[A,D]", "data.out_of_federation=[]")
    original = site_module.Site.train_round

    def d_fails(self, received, server_round, local_iters, **kwargs):
        if self.name == "D":
            raise ConnectionError("hospital D lost power")
        return original(self, received, server_round, local_iters, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(site_module.Site, "train_round", d_fails)
        with pytest.raises(FederationError, match="hospital D lost power"):
            _inprocess_run(cfg, tmp_path / "run", RoundPolicy(min_sites=2))


class ConnectedNodes:
    """The two Grid calls of the server's wait for its sites: connected node ids, and their
    NodeInfo with the name each key was registered under ("" for none, as Flower reports it)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names

    def get_node_ids(self) -> list[int]:
        return list(self.names)

    def get_nodes(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(node_id=n, name=name) for n, name in self.names.items()]


@pytest.mark.parametrize(
    ("names", "learnt", "says"),
    [
        ({7: "D"}, {}, "connected: D; not connected: A."),  # its registered name
        ({7: ""}, {7: "D"}, "connected: D; not connected: A."),  # learnt from its replies
        ({7: ""}, {}, "1 connected node(s) not identified yet; 1 of A, D not connected."),
    ],
)
def test_too_few_sites_stop_the_run_naming_as_missing_only_sites_not_counted_connected(
    names, learnt, says
):
    """A resumed server has learnt no node's site from replies yet; the count of connected sites
    and the list of missing ones must still agree."""
    with pytest.raises(FederationError) as caught:
        messaging.wait_for_nodes(ConnectedNodes(names), 2, 0.0, ["A", "D"], learnt)
    assert str(caught.value).startswith(f"1 of 2 sites connected after 0 s (need 2); {says}")


def test_two_nodes_claiming_the_same_site_stop_the_run(tiny_root, tmp_path):
    cfg = experiment(tiny_root, "data.federation=[A,D]", "data.out_of_federation=[]")
    with pytest.raises(FederationError, match="claim site A"):
        _inprocess_run(cfg, tmp_path / "run", RoundPolicy(), node_sites=["A", "A"])


def test_a_cached_site_whose_handler_raised_is_dropped_so_the_next_message_rebuilds_it():
    from fedst.app import client_app as module

    def cached(name: str) -> SimpleNamespace:  # what release_sites needs of a Site
        return SimpleNamespace(name=name, close_loaders=lambda: None)

    kept, failed = cached("A"), cached("B")
    module._SITES.update({("run/A", "A", "f"): kept, ("run/B", "B", "f"): failed})
    try:
        with module._forget_on_error(kept):
            pass
        with pytest.raises(RuntimeError), module._forget_on_error(failed):
            raise RuntimeError("half-way through a round")
        assert {("run/A", "A", "f"): kept} == module._SITES
    finally:
        release_sites()
