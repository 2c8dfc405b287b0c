"""Specification of SERQ's feature bank on disk (fedst/methods/feature_bank.py): server.pt holds
no bank; each save writes only the entries changed since the previous one; resuming restores the
bank of server.pt's round exactly, also after a crash between the bank's write and server.pt's,
and after a fall back to server.prev.pt. Each holds for both working banks (serq.bank_storage:
a dict in memory, or the scratch file of DiskFeatureBank), and both give the same SERQ.
Device: the CPU (every server here is built on torch.device("cpu")), where the bit-for-bit
comparisons hold without deterministic switches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedst.data.procedural import generate
from fedst.federation.server import FederationServer
from fedst.methods.feature_bank import FEATURE_BANK_DIR, SERQ_BANK_SCRATCH, DiskFeatureBank
from fedst.runs.layout import SERVER_CHECKPOINT
from fedst.seeding import seed_everything
from fedst.storage import load_checkpoint
from tests.test_federation import experiment


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


@pytest.fixture(params=["memory", "disk"])
def storage(request: pytest.FixtureRequest) -> str:
    """serq.bank_storage of the servers a test builds."""
    return request.param


def new_server(root: Path, run_dir: Path, storage: str = "memory") -> FederationServer:
    cfg = experiment(
        root, "serq.batches_per_round=2", "serq.batch_size=2", f"serq.bank_storage={storage}"
    )
    return FederationServer(cfg, run_dir, torch.device("cpu"))


def run_round(server: FederationServer, server_round: int) -> set[str]:
    """One SERQ round; returns the samples whose bank entry it changed."""
    seed_everything(server.cfg.seed, 0x5E12, server_round)
    before = {k: v.clone() for k, v in server.step.serq.feature_bank.items()}
    server.step.serq.step(server.global_model)
    bank = server.step.serq.feature_bank
    return {k for k, v in bank.items() if k not in before or not torch.equal(v, before[k])}


def snapshot(server: FederationServer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in server.step.serq.feature_bank.items()}


def assert_same_bank(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == torch.float16 and torch.equal(got[key], value), key


def files_of_round(run_dir: Path, server_round: int) -> list[Path]:
    return sorted((run_dir / FEATURE_BANK_DIR).glob(f"*.r{server_round:06d}.pt"))


@pytest.fixture
def saved_two_rounds(tiny_root: Path, tmp_path: Path, storage: str):
    """A server after rounds 1 and 2, each saved; the banks of both rounds and round 2's changes."""
    server = new_server(tiny_root, tmp_path, storage)
    server.save(0)
    run_round(server, 1)
    server.save(1)
    bank_1 = snapshot(server)
    changed = run_round(server, 2)
    written = server.save(2)
    return server, bank_1, snapshot(server), changed, written


def test_a_save_writes_only_the_changed_entries_and_resume_restores_the_bank(
    saved_two_rounds,
    tiny_root,
    tmp_path,
    storage,
):
    _, _, bank_2, changed, written = saved_two_rounds
    assert 0 < len(changed) < len(bank_2)  # the round changed part of the bank
    round_2 = files_of_round(tmp_path, 2)
    assert written["bank_entries_written"] == len(round_2) == len(changed)
    server_pt = (tmp_path / SERVER_CHECKPOINT).stat().st_size
    assert written["checkpoint_bytes"] == server_pt + sum(p.stat().st_size for p in round_2)
    assert written["checkpoint_seconds"] > 0
    state = load_checkpoint(tmp_path / SERVER_CHECKPOINT)
    assert "feature_bank" not in state["method"]["server_step"]  # server.pt holds no bank

    resumed = new_server(tiny_root, tmp_path, storage)
    resumed.load()
    assert_same_bank(resumed.step.serq.feature_bank, bank_2)


def round_revisiting_the_bank(server: FederationServer, next_round: int) -> tuple[int, dict, set]:
    """Run (and save) rounds from ``next_round`` on until one changes an entry that was already
    in the bank; that round is not saved. Returns it, the bank before it and its changes."""
    while True:
        before = snapshot(server)
        changed = run_round(server, next_round)
        if changed & before.keys():
            return next_round, before, changed
        server.save(next_round)
        next_round += 1


def test_bank_entries_written_before_a_crash_are_rolled_back_to_server_pt_s_round(
    saved_two_rounds, tiny_root, tmp_path, storage
):
    server = saved_two_rounds[0]
    crashed, bank_saved, _ = round_revisiting_the_bank(server, 3)
    server.step.serq.save_feature_bank(server.step.store, crashed)  # ... then dies: no server.pt
    assert files_of_round(tmp_path, crashed)

    resumed = new_server(tiny_root, tmp_path, storage)
    resumed.load()
    assert resumed.completed_round == crashed - 1
    assert_same_bank(resumed.step.serq.feature_bank, bank_saved)
    assert not files_of_round(tmp_path, crashed)  # the abandoned round's entries are gone
    changed = run_round(resumed, crashed)  # the re-run round writes its entries again
    assert resumed.save(crashed)["bank_entries_written"] == len(changed)


def test_a_fall_back_to_server_prev_pt_restores_the_previous_round_s_bank(
    saved_two_rounds, tiny_root, tmp_path, storage
):
    server = saved_two_rounds[0]
    last, bank_previous, _ = round_revisiting_the_bank(server, 3)
    server.save(last)  # server.prev.pt: round last - 1, whose entries ``last`` superseded
    (tmp_path / SERVER_CHECKPOINT).write_bytes(b"damaged")

    resumed = new_server(tiny_root, tmp_path, storage)
    resumed.load()
    assert resumed.completed_round == last - 1
    assert_same_bank(resumed.step.serq.feature_bank, bank_previous)


def test_the_disk_bank_gives_the_same_serq_as_the_memory_bank_and_leaves_no_scratch_file(
    tiny_root, tmp_path
):
    servers = {
        storage: new_server(tiny_root, tmp_path / storage, storage)
        for storage in ("memory", "disk")
    }
    assert isinstance(servers["disk"].step.serq.feature_bank, DiskFeatureBank)
    assert isinstance(servers["memory"].step.serq.feature_bank, dict)
    for server_round in (1, 2, 3):
        for server in servers.values():
            run_round(server, server_round)
    memory, disk = servers["memory"], servers["disk"]
    assert_same_bank(disk.step.serq.feature_bank, snapshot(memory))
    disk_state, memory_state = disk.global_model.state_dict(), memory.global_model.state_dict()
    assert all(torch.equal(disk_state[k], memory_state[k]) for k in memory_state)
    assert torch.equal(disk.step.serq.domain_descriptor, memory.step.serq.domain_descriptor)
    scratch = tmp_path / "disk" / SERQ_BANK_SCRATCH
    assert scratch.stat().st_size > 0
    disk.close()
    assert not scratch.exists()


def test_a_checkpoint_from_before_the_server_step_hook_resumes_serq_the_same(
    saved_two_rounds, tiny_root, tmp_path, storage
):
    """Checkpoints written before SERQ moved behind Method.server_step hold its state under a
    top-level "serq" key (and none in "method"): resuming one restores the same SERQ."""
    server, _, bank_2, _, _ = saved_two_rounds
    path = tmp_path / SERVER_CHECKPOINT
    state = load_checkpoint(path)
    state["serq"] = state["method"].pop("server_step")  # the layout of the older checkpoints
    torch.save(state, path)
    resumed = new_server(tiny_root, tmp_path, storage)
    resumed.load()
    assert_same_bank(resumed.step.serq.feature_bank, bank_2)
    assert torch.equal(resumed.step.serq.domain_descriptor, server.step.serq.domain_descriptor)
    for key, value in server.step.serq.synthetic_model.state_dict().items():
        assert torch.equal(resumed.step.serq.synthetic_model.state_dict()[key], value), key
    assert resumed.step.serq.pretrained_iters == server.step.serq.pretrained_iters
