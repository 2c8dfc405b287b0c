"""Specification of how the training steps are fed and launched (issue 33, items 3 and 4): loader
workers from the cores a loader has alone, persistent loaders for SERQ's passes that give the
batches a fresh loader of the same seed gives, the working bank read and written a batch at a
time, Eq. 10 on the device, ``train.compile`` as a mode (the former boolean mapped) that reaches
the site's step and SERQ's passes, and ``train.channels_last``. Runs on the CPU: the CUDA paths
are reached through a CUDA device object (layouts) or a recording ``torch.compile``."""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest
import torch

from fedst import accel
from fedst.cli import compose_experiment
from fedst.config import ConfigError, to_dict
from fedst.data import clips
from fedst.data.clips import BatchStream, ClipDataset
from fedst.data.generic import GenericLayoutSource
from fedst.experiment import TrainConfig, experiment_from_json
from fedst.methods import feature_bank, method_of
from fedst.methods.feature_bank import DiskFeatureBank, read_entries, write_entries
from fedst.methods.serq import Serq
from tests.conftest import write_generic_site

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


# -- loader workers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cores", "parallel", "workers"),
    [(16, 1, 4), (16, 4, 3), (16, 5, 2), (16, 16, 0), (2, 4, 0), (1, 1, 0), (64, 2, 4), (10, 2, 4)],
)
def test_auto_workers_are_a_loaders_share_of_the_cores_less_the_training_core_at_most_four(
    monkeypatch, cores, parallel, workers
):
    # expected: min(4, floor(cores / loaders running at once) - 1), at least 0
    monkeypatch.setattr(clips.loaders, "usable_cpu_count", lambda: cores)
    assert clips.resolve_num_workers("auto", parallel_loaders=parallel) == workers
    assert clips.resolve_num_workers("auto", parallel, cpu_count=cores) == workers
    assert clips.resolve_num_workers(5, parallel_loaders=parallel) == 5  # a number as given


def test_parallel_loaders_must_be_at_least_one():
    with pytest.raises(ValueError, match="parallel_loaders=0"):
        clips.resolve_num_workers("auto", parallel_loaders=0)


# -- persistent loaders for SERQ's passes --------------------------------------------------------


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> GenericLayoutSource:
    root = tmp_path_factory.mktemp("synthetic")
    write_generic_site(root, "synthetic", videos={"v0": 5, "v1": 4}, size=(32, 40))
    return GenericLayoutSource(root, "synthetic")


def datasets(source: GenericLayoutSource) -> tuple[ClipDataset, ClipDataset]:
    cfg, _ = compose_experiment(["experiment=tiny"])
    clip = dataclasses.replace(cfg.clip_config(), num_frames=1)
    augmented = ClipDataset(source, "train", clip, cfg.augment)
    return augmented, ClipDataset(source, "train", clip, None, validate=False)


def worker_pids(stream: BatchStream, dataset: ClipDataset) -> list[int]:
    iterator = stream._loader_of(dataset).loader._iterator
    return [worker.pid for worker in iterator._workers]


def test_serq_loaders_persist_across_rounds_and_give_a_fresh_loaders_batches(synthetic):
    augmented, reference = datasets(synthetic)
    stream = BatchStream(augmented, batch_size=2, seed=7, num_workers=1)
    fresh = BatchStream(augmented, batch_size=2, seed=7, num_workers=0)  # built independently
    loaders, pids = [], []
    for _ in range(3):  # rounds; 3 x 3 batches of 2 cross the 9-sample epoch
        plan = stream.next_plan(3)
        got = list(stream.load_plan(plan))
        canonical = list(stream.load_plan(plan, reference))
        expected = [fresh.next_batch() for _ in range(3)]
        for (images, masks, ids), (want_images, want_masks, want_ids) in zip(
            got, expected, strict=True
        ):
            assert ids == want_ids
            assert torch.equal(images, want_images) and torch.equal(masks, want_masks)
        for (images, masks, ids), batch in zip(canonical, plan, strict=True):
            items = [reference[index] for index, _ in batch]  # un-augmented, read directly
            assert ids == [item[2] for item in items]
            assert torch.equal(images, torch.stack([item[0] for item in items]))
            assert torch.equal(masks, torch.stack([item[1] for item in items]))
        loaders.append([stream._loader_of(d).loader for d in (augmented, reference)])
        pids.append(worker_pids(stream, augmented) + worker_pids(stream, reference))
    assert all(round_loaders == loaders[0] for round_loaders in loaders)  # the same objects
    assert all(round_pids == pids[0] for round_pids in pids)  # the same worker processes
    workers = [stream._loader_of(d).loader._iterator._workers[0] for d in (augmented, reference)]
    stream.close()
    for worker in workers:
        worker.join(timeout=10)
    assert not any(worker.is_alive() for worker in workers)  # close() ends them


def test_a_pass_overtaken_by_another_on_the_same_dataset_says_so(synthetic):
    augmented, _ = datasets(synthetic)
    stream = BatchStream(augmented, batch_size=2, seed=7)
    first = iter(stream.load_plan(stream.next_plan(2)))
    next(first)
    list(stream.load_plan(stream.next_plan(2)))
    with pytest.raises(RuntimeError, match="went stale"):
        next(first)


def test_training_batches_are_pinned_only_for_a_cuda_device(synthetic, monkeypatch):
    augmented, _ = datasets(synthetic)
    seen = []
    real = torch.utils.data.DataLoader.__init__

    def recording(self, *args, **kwargs):
        seen.append((kwargs["pin_memory"], kwargs["persistent_workers"], kwargs["prefetch_factor"]))
        real(self, *args, **kwargs)

    monkeypatch.setattr(torch.utils.data.DataLoader, "__init__", recording)
    # constructing the DataLoader needs no CUDA; only iterating a pinned one would
    BatchStream(augmented, 2, 0, num_workers=2, device=CUDA)._loader_of(augmented)
    BatchStream(augmented, 2, 0, num_workers=0, device=CPU)._loader_of(augmented)
    assert seen == [(True, True, clips.loaders.PREFETCH_FACTOR), (False, False, None)]


# -- the working bank, a batch at a time ---------------------------------------------------------


def test_disk_bank_reads_and_writes_a_batch_with_one_call_per_run_of_slots(tmp_path, monkeypatch):
    bank = DiskFeatureBank(tmp_path / "bank.work")
    entries = torch.randn(5, 2, 3, 4).half()
    calls = {"pwrite": 0, "preadv": 0}

    def counted(name: str):
        real = getattr(os, name)

        def call(*args):
            calls[name] += 1
            return real(*args)

        return call

    for name in calls:
        monkeypatch.setattr(feature_bank.os, name, counted(name))
    write_entries(bank, ["a", "b", "c", "d", "e"], entries)  # slots 0-4: one run
    assert calls["pwrite"] == 1
    got = read_entries(bank, ["b", "c", "e", "a"])  # slots 1, 2 | 4 | 0: three runs
    assert calls["preadv"] == 3
    assert torch.equal(got, entries[[1, 2, 4, 0]])
    write_entries(bank, ["c", "c"], torch.stack([entries[0], entries[4]]))  # the last one wins
    assert torch.equal(bank["c"], entries[4]) and torch.equal(bank["d"], entries[3])
    memory = {}
    write_entries(memory, ["a", "b"], entries[:2])
    assert torch.equal(read_entries(memory, ["b", "a"]), entries[[1, 0]])
    assert memory["a"].untyped_storage().data_ptr() != entries.untyped_storage().data_ptr()


@pytest.fixture
def serq(synthetic) -> Serq:
    cfg, _ = compose_experiment(["experiment=tiny"])
    augmented, reference = datasets(synthetic)
    global_model = method_of(cfg).build_model()
    return Serq(
        dataclasses.replace(cfg.serq, batches_per_round=2, batch_size=3, ema_mu=0.3),
        synthetic_model=copy.deepcopy(global_model),
        stream=BatchStream(augmented, batch_size=3, seed=0),
        reference=reference,
        indicator=method_of(cfg).indicators().get("synthetic"),
        loss_fn=method_of(cfg).segmentation_loss(),
        device=CPU,
        feature_stage=1,
    )


def test_eq_updates_the_bank_by_eq_10_sample_by_sample_in_batch_order(serq):
    """The bank follows the batches' ids, whatever their images."""
    global_model = method_of(compose_experiment(["experiment=tiny"])[0]).build_model()
    ids = [serq.reference.sample_id(i) for i in range(3)]
    a, b, c = ids
    batches = [[a, b, a], [c, a, b]]  # a twice in one batch, and again in the next
    # the images of c's view under the second a: the two updates of a then differ
    views = [serq.canonical_view([a, b, c]), serq.canonical_view(batches[1])]
    views[0] = (*views[0][:2], batches[0])
    stored = torch.randn(*serq.domain_descriptor.shape).half()
    serq.feature_bank[b] = stored.clone()  # b has an entry from an earlier round; a, c none
    with torch.no_grad():
        global_model.eval()
        features = [serq._features(global_model, images).half() for images, _, _ in views]
    mu = 0.3
    expected = {b: stored}  # Eq. 10 one sample at a time, as written in the paper
    for batch, feats in zip(batches, features, strict=True):
        for sample_id, new in zip(batch, feats, strict=True):
            old = expected.get(sample_id)
            expected[sample_id] = (
                new if old is None else ((1 - mu) * old.float() + mu * new.float()).half()
            )
    serq.explicit_quantification(global_model, views)
    assert set(serq.feature_bank) == {a, b, c}
    for sample_id, entry in expected.items():
        assert torch.equal(serq.feature_bank[sample_id], entry), sample_id
    assert serq._bank_changed == {a, b, c}


# -- train.compile and train.channels_last -------------------------------------------------------


def test_compile_is_a_mode_and_the_former_boolean_maps_to_one():
    assert TrainConfig().compile == "none" and TrainConfig().channels_last is False
    assert TrainConfig(compile=True).compile == "default"
    assert TrainConfig(compile=False).compile == "none"
    for mode in ("none", "default", "reduce-overhead", "max-autotune"):
        assert TrainConfig(compile=mode).compile == mode
    with pytest.raises(ConfigError, match=r"train\.compile='fast'.*reduce-overhead"):
        TrainConfig(compile="fast")


def test_compile_and_channels_last_parse_from_overrides_and_old_configs(tmp_path):
    cfg, _ = compose_experiment(
        ["experiment=tiny", "train.compile=reduce-overhead", "train.channels_last=true"]
    )
    assert (cfg.train.compile, cfg.train.channels_last) == ("reduce-overhead", True)
    recorded = to_dict(cfg)["train"]  # what the run's config.json holds
    assert (recorded["compile"], recorded["channels_last"]) == ("reduce-overhead", True)
    old = to_dict(compose_experiment(["experiment=tiny"])[0])
    old["train"]["compile"] = True  # a config.json written when compile was a boolean
    del old["train"]["channels_last"]
    restored = experiment_from_json(json.dumps(old))
    assert (restored.train.compile, restored.train.channels_last) == ("default", False)


def test_maybe_compile_passes_the_mode_to_torch_compile_and_none_compiles_nothing(monkeypatch):
    calls = []

    def fake_compile(fn, mode=None):
        calls.append(mode)
        return lambda *args: ("compiled", fn(*args))

    monkeypatch.setattr(torch, "compile", fake_compile)

    def step(x):
        return x + 1

    assert accel.maybe_compile(step, "none") is step and calls == []
    assert accel.maybe_compile(step, False) is step and calls == []  # the former boolean
    assert accel.maybe_compile(step, "reduce-overhead")(1) == ("compiled", 2)
    assert calls == ["reduce-overhead"]
    with pytest.raises(ValueError, match=r"train\.compile='fast'"):
        accel.maybe_compile(step, "fast")


def test_cuda_graphs_only_for_their_modes_on_cuda_and_their_outputs_are_copied():
    assert accel.uses_cuda_graphs("reduce-overhead", CUDA)
    assert accel.uses_cuda_graphs("max-autotune", CUDA)
    assert not accel.uses_cuda_graphs("default", CUDA)
    assert not accel.uses_cuda_graphs("reduce-overhead", CPU)
    loss = torch.tensor(2.0, requires_grad=True) * 1
    copy_ = accel.kept(loss, cuda_graphs=True)
    assert copy_.data_ptr() != loss.data_ptr() and not copy_.requires_grad and copy_ == loss
    assert accel.kept(loss, cuda_graphs=False).data_ptr() == loss.data_ptr()


def test_the_site_step_and_serqs_passes_are_compiled_with_the_configured_mode(
    tmp_path, monkeypatch
):
    compiled: dict[str, list] = {}

    def recording_compile(fn, mode=None):
        name = fn.__qualname__
        compiled[name] = [mode, 0]

        def run(*args):
            compiled[name][1] += 1
            return fn(*args)

        return run

    monkeypatch.setattr(torch, "compile", recording_compile)
    from fedst.data.procedural import generate
    from fedst.federation.server import FederationServer
    from fedst.federation.site import Site
    from fedst.federation.state_writer import wait_for_state_writes
    from tests.test_federation import experiment

    root = tmp_path / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    cfg = experiment(
        root,
        "train.compile=reduce-overhead",
        "serq.batches_per_round=1",
        "pretraining.iters=0",
        "train.num_workers=0",
    )
    server = FederationServer(cfg, tmp_path / "run", CPU)
    server.step.serq.step(server.global_model)
    site = Site(cfg.data.federation[0], cfg, tmp_path / "site", CPU)
    site.train_round(server.initial_payload(), 1, local_iters=2)
    assert compiled == {
        "Serq._eq_objective": ["reduce-overhead", 1],
        "Serq._sc_objective": ["reduce-overhead", 1],
        "Serq._features": ["reduce-overhead", 1],  # the bank's F_g
        "Site._forward_loss": ["reduce-overhead", 2],
    }
    wait_for_state_writes(tmp_path / "site")  # its state file, written behind the round


def test_channels_last_converts_the_model_on_cuda_only_and_keeps_values():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 2, 1))
    before = copy.deepcopy(model.state_dict())
    assert accel.use_channels_last(model, CPU, enabled=True) is False
    assert not model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert accel.use_channels_last(model, CUDA, enabled=False) is False
    # the CUDA device object only selects the path; the CPU model's layout changes in place
    assert accel.use_channels_last(model, CUDA, enabled=True) is True
    for conv in model:
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert list(model.state_dict()) == list(before)


def test_channels_last_clips_keep_their_values_with_frames_in_nhwc():
    clips_ = torch.randn(2, 3, 3, 5, 6)  # [B, T, 3, H, W]
    converted = accel.clips_channels_last(clips_)
    assert torch.equal(converted, clips_)
    assert converted.flatten(0, 1).is_contiguous(memory_format=torch.channels_last)
    assert converted.stride()[2] == 1  # channels innermost


def test_optimizer_moments_take_their_parameters_layout():
    conv = torch.nn.Conv2d(3, 4, 3)
    optimizer = torch.optim.Adam(conv.parameters())
    conv(torch.randn(1, 3, 5, 5)).sum().backward()
    optimizer.step()  # NCHW moments, as a checkpoint of a run without channels_last holds
    moments = {k: v.clone() for k, v in optimizer.state[conv.weight].items()}
    conv.to(memory_format=torch.channels_last)
    accel.match_parameter_layouts(optimizer)
    for key, value in optimizer.state[conv.weight].items():
        assert torch.equal(value, moments[key])
        if value.shape == conv.weight.shape:
            assert value.stride() == conv.weight.stride(), key


def test_ray_site_actors_get_auto_workers_from_their_cpu_share(monkeypatch, tmp_path):
    """Ray runs the sites' actors at once: "auto" gives each site's node its actor's CPU share
    less one core (16 cores mocked), not the whole machine's."""
    import flwr.simulation

    from fedst import training

    seen: dict = {}

    def make_client_app(nodes, **kwargs):
        seen["nodes"] = nodes

    def run_simulation(**kwargs):
        raise SystemExit  # stop before any round

    monkeypatch.setattr(flwr.simulation, "run_simulation", run_simulation)
    monkeypatch.setattr(training, "require_ray", lambda: None)  # Flower's simulation is mocked
    monkeypatch.setattr(training, "make_client_app", make_client_app)
    monkeypatch.setattr(training, "usable_cpu_count", lambda: 16)
    monkeypatch.setattr(training, "prepare_run", lambda *args, **kwargs: None)
    monkeypatch.setattr(training, "make_server_app", lambda *args, **kwargs: None)
    cfg, _ = compose_experiment(
        ["experiment=tiny", f"data.root={tmp_path}", "train.num_workers=auto"]
    )
    with pytest.raises(SystemExit):
        training.run_training(cfg, tmp_path / "run", engine="ray", progress=False)
    sites = len(seen["nodes"])
    assert sites > 1
    assert [node["num-workers"] for node in seen["nodes"]] == [16 // sites - 1] * sites
