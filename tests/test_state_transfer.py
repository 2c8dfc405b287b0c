"""Specification of a site round's per-round costs (issue 60, item 3): gamma_k, rho_k and the
optimizer state reach the host in bulk copies (one per device each: 2 a round, gamma_k's shared
by the reply and the save), and the state file is written by a background writer that finishes
before the site's next save; a failed write leaves the previous states as they were.

What the CPU can show: the bulk copy's device-to-host count is measured on CUDA tensors of a
FakeTensorMode (no GPU needed, ops dispatched as on CUDA); a real site round counts the bulk
copies through their seam (``fedst.federation.site.bulk_to_host``) and checks that no tensor is
copied to the host one by one (``aten._to_copy`` to the CPU with its dtype kept: the former
per-tensor path, also on the CPU). The 738 implicit copies ``torch.save`` made of the optimizer's
CUDA tensors cannot be seen on the CPU; the payload handed to the writer holds host tensors
only, so there are none left to make."""

from __future__ import annotations

import collections
import threading
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fedst.accel import bulk_to_host, standalone
from fedst.accel.transfer import _leaves
from fedst.data.procedural import generate
from fedst.federation import site as site_module
from fedst.federation.site import Site
from fedst.federation.state_writer import wait_for_state_writes
from fedst.model.state import state_subset
from fedst.storage import load_checkpoint
from tests.test_federation import experiment

pytestmark = pytest.mark.usefixtures("single_torch_thread")

CPU = torch.device("cpu")


class CopyCounter(TorchDispatchMode):
    """Counts copies by (op, source device, target device, dtype kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple[str, str, str, bool]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_"):
            source, target = (args[1], args[0]) if name == "copy_" else (args[0], out)
            key = (name, source.device.type, target.device.type, source.dtype == target.dtype)
            self.counts[key] += 1
        return out

    def to_host(self, source: str) -> int:
        return sum(n for (_, s, t, _), n in self.counts.items() if s == source and t == "cpu")


def a_state(device: str) -> dict:
    """724 tensors (240 x 3 + 4) of mixed dtypes and shapes, nested as an optimizer's state."""
    state = {
        i: {
            "step": torch.tensor(float(i), device=device),
            "exp_avg": torch.randn(3, i % 5 + 1, device=device),
            "exp_avg_sq": torch.rand(i % 7 + 1, device=device).half(),
        }
        for i in range(240)
    }
    return {
        "state": state,
        "param_groups": [{"lr": 1e-4, "params": list(range(240))}],
        "extra": (torch.arange(5, device=device), torch.ones(2, 2, device=device) > 0),
        "counter": torch.tensor(7, device=device),
        "strided": torch.randn(4, 6, device=device)[:, ::2],
    }


def tensors_of(tree) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _leaves(tree, found)
    return found


def test_a_states_cuda_tensors_reach_the_host_in_one_copy():
    with FakeTensorMode(allow_non_fake_inputs=True), CopyCounter() as counter:
        state = a_state("cuda")
        assert len(tensors_of(state)) == 724
        copied = bulk_to_host(state)
    assert copied.copies == 1
    assert counter.to_host("cuda") == 1  # 724 tensors, one device-to-host copy
    host = tensors_of(copied.tree)
    assert {t.device.type for t in host} == {"cpu"}
    assert len({t.untyped_storage().data_ptr() for t in host}) == 1  # views of one buffer


def test_a_bulk_copy_keeps_every_value_dtype_and_shape_and_shares_no_memory():
    state = a_state("cpu")
    copied = bulk_to_host(state).wait()
    assert copied["param_groups"] == state["param_groups"]
    for before, after in zip(tensors_of(state), tensors_of(copied), strict=True):
        assert after.dtype == before.dtype and after.shape == before.shape
        assert torch.equal(after, before)
        assert after.untyped_storage().data_ptr() != before.untyped_storage().data_ptr()
    separate = tensors_of(standalone(copied))  # what the writer saves: a storage per tensor
    assert len({t.untyped_storage().data_ptr() for t in separate}) == len(separate)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


def a_site(tiny_root: Path, state_dir: Path) -> tuple[Site, dict[str, torch.Tensor]]:
    cfg = experiment(tiny_root, "train.num_workers=0", "pretraining.iters=0")
    site = Site(cfg.data.federation[0], cfg, state_dir, CPU)
    received = state_subset(site.model, [*site.partition.shared, *site.partition.personal])
    return site, received


def test_a_site_round_copies_its_state_to_the_host_in_two_bulk_copies(
    tiny_root, tmp_path, monkeypatch
):
    site, received = a_site(tiny_root, tmp_path / "site")
    bulk_copies = []

    def counted(tree):
        bulk_copies.append(len(tensors_of(tree)))
        return bulk_to_host(tree)

    monkeypatch.setattr(site_module, "bulk_to_host", counted)
    site.train_round(received, 1, local_iters=1)  # the optimizer's state exists from round 1
    wait_for_state_writes()
    bulk_copies.clear()
    with CopyCounter() as counter:
        result = site.train_round(received, 2, local_iters=1)
        wait_for_state_writes()
    moments = 2 * len(list(site.model.parameters()))  # AdamW's exp_avg, exp_avg_sq
    assert len(bulk_copies) == 2  # gamma_k; then rho_k, the optimizer's state and the rest
    assert bulk_copies[0] == len(site.partition.shared)
    assert bulk_copies[1] >= len(site.partition.personal) + moments
    per_tensor = sum(
        n
        for (op, s, t, kept), n in counter.counts.items()
        if op == "_to_copy" and t == "cpu" and kept
    )
    assert per_tensor == 0  # nothing copied to the host tensor by tensor
    sent = list(result.shared.values())
    assert len({t.untyped_storage().data_ptr() for t in sent}) == 1  # gamma_k copied once
    saved = load_checkpoint(site.state_path(2), CPU)
    assert saved["shared"].keys() == result.shared.keys()
    for key, value in result.shared.items():
        assert torch.equal(saved["shared"][key], value)
    live = site.model.state_dict()
    for key in site.partition.personal:
        assert torch.equal(saved["personal"][key], live[key])


def test_the_state_file_is_written_behind_the_round_and_before_the_next_save(
    tiny_root, tmp_path, monkeypatch
):
    site, received = a_site(tiny_root, tmp_path / "site")
    gate, written = threading.Event(), []
    write = site_module.atomic_torch_save

    def gated(state, path):
        assert threading.current_thread() is not threading.main_thread()
        assert gate.wait(timeout=120)
        if state["round"] == 3:
            raise OSError(28, "No space left on device")
        write(state, path)
        written.append(state["round"])

    monkeypatch.setattr(site_module, "atomic_torch_save", gated)
    site.train_round(received, 1, local_iters=1)
    assert written == [] and not site.state_path(1).exists()  # the round ended first
    threading.Timer(0.5, gate.set).start()
    site.train_round(received, 2, local_iters=1)  # waits for round 1's file before reading
    assert written[0] == 1
    wait_for_state_writes()
    assert written == [1, 2]
    before = {r: site.state_path(r).read_bytes() for r in (1, 2)}
    site.train_round(received, 3, local_iters=1)  # its write fails on the writer thread
    with pytest.raises(OSError, match="No space left"):
        wait_for_state_writes()
    assert not site.state_path(3).exists()
    assert {r: site.state_path(r).read_bytes() for r in (1, 2)} == before
