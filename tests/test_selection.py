"""Specifications of honest model selection: the rules on a constructed metrics log, validation
splits of whole training videos, and (on one tiny federation with a held-out CBE site) that the
held-out site never trains, that selection reads no test frame and that the cross-site matrix's
diagonal is the per-site result of the same checkpoints."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import pytest
import torch

from fedst.accel import resolve_device
from fedst.app.inprocess import InProcessGrid
from fedst.config import ConfigError
from fedst.data.base import DataError
from fedst.data.generic import GenericLayoutSource
from fedst.data.procedural import generate
from fedst.data.sites import DataConfig, SiteSpec
from fedst.data.splits import CarvedValidationSource, validation_videos, with_validation_split
from fedst.federation.site import Site
from fedst.methods import method_of
from fedst.report.selection import cross_site_matrix
from fedst.runs import Run
from fedst.runs import model_selection as selection
from fedst.runs.layout import SERVER_CHECKPOINT, site_state_dir, site_state_file
from fedst.scoring.evaluation import stream_test_clips
from fedst.scoring.site_data import open_site_data
from fedst.storage import load_checkpoint, read_jsonl
from fedst.training import run_training
from tests.conftest import classifier_bias, record_reads
from tests.test_federation import experiment

# -- the rules on a constructed log -----------------------------------------------------------


def val_row(site: str, rnd: int, dice: float | None, frames: int, model: str = "personal") -> dict:
    return {
        "round": rnd,
        "site": site,
        "split": "val",
        "model": model,
        "dice": dice,
        "num_frames": frames,
    }


def make_test_row(site: str, rnd: int, dice: float) -> dict:
    return {
        "round": rnd,
        "site": site,
        "split": "test",
        "model": "personal",
        "dice": dice,
        "num_frames": 5,
    }


@pytest.fixture
def constructed_log() -> list[dict]:
    """Validation of A (10 frames) and B (30 frames) at rounds 2, 4, 6; held-out site D's
    out-of-federation rows; and test rows that would pick other rounds if they were read.

    By hand: val A -> 4 (0.90), val B -> 6 (0.45). Pooled (frame-weighted) r2 = (5 + 12) / 40 =
    0.425, r4 = (9 + 6) / 40 = 0.375, r6 = (6 + 13.5) / 40 = 0.4875 -> mixed 6 (an unweighted
    mean would pick r4: 0.55 > 0.525). cbe: D 0.30 / 0.35 / 0.20 -> 4. last: 6. MSF: 6 != 4.
    """
    rows = [
        val_row("A", 2, 0.50, 10),
        val_row("A", 4, 0.90, 10),
        val_row("A", 6, 0.60, 10),
        val_row("B", 2, 0.40, 30),
        val_row("B", 4, 0.20, 30),
        val_row("B", 6, 0.45, 30),
        val_row("D", 2, 0.30, 8, "outfed"),
        val_row("D", 4, 0.35, 8, "outfed"),
        val_row("D", 6, 0.20, 8, "outfed"),
    ]
    rows += [make_test_row("A", 2, 0.99), make_test_row("B", 2, 0.99), make_test_row("A", 8, 0.1)]
    return rows


def test_each_rule_picks_the_hand_derived_round_on_a_constructed_log(constructed_log):
    choices = selection.choose(constructed_log, ["A", "B"], held_out="D")
    assert choices["last"].sites == {"A": 6, "B": 6}
    assert choices["val"].sites == {"A": 4, "B": 6}
    assert choices["val"].outfed is None
    assert choices["mixed"].sites == {"A": 6, "B": 6} and choices["mixed"].outfed == 6
    assert choices["cbe"].outfed == 4 and choices["cbe"].sites == {"A": 4, "B": 4}
    assert selection.model_selection_failure(choices) is True


def test_the_pooled_score_weights_each_site_by_its_validation_frames(constructed_log):
    pooled = selection.pooled_scores(constructed_log, ["A", "B"])
    assert pooled == pytest.approx({2: 0.425, 4: 0.375, 6: 0.4875})


def test_test_rows_never_change_a_choice(constructed_log):
    only_val = [r for r in constructed_log if r["split"] == "val"]
    assert selection.choose(constructed_log, ["A", "B"], "D") == selection.choose(
        only_val, ["A", "B"], "D"
    )


def test_ties_go_to_the_earliest_round_and_unscored_rounds_are_not_candidates():
    rows = [val_row("A", 1, 0.5, 4), val_row("A", 2, 0.5, 4), val_row("A", 3, None, 4)]
    rows += [val_row("B", 1, 0.1, 4), val_row("B", 2, 0.1, 4), val_row("B", 3, 0.9, 4)]
    assert selection.select_val(rows) == {"A": 1, "B": 3}
    assert selection.select_mixed(rows, ["A", "B"]) == 1  # round 3 lacks A's score


def test_no_mixed_or_cbe_choice_without_the_rows_it_needs():
    with pytest.raises(selection.SelectionError, match="rule cbe"):
        selection.select_cbe([val_row("A", 1, 0.5, 4)], "D")
    with pytest.raises(selection.SelectionError, match="rule mixed"):
        selection.select_mixed([val_row("A", 1, 0.5, 4)], ["A", "B"])


# -- validation splits ------------------------------------------------------------------------


def hand_carved(video_ids: list[str], site: str, count: int, seed: int) -> set[str]:
    ranked = sorted(
        video_ids, key=lambda v: hashlib.sha256(f"{seed}/{site}/{v}".encode()).hexdigest()
    )
    return set(ranked[:count])


def test_a_carved_validation_split_is_whole_training_videos_chosen_by_the_seed(write_site):
    train = [f"v{i}" for i in range(6)]
    written = write_site(
        "A",
        dict.fromkeys([*train, "t0", "t1"], 3),
        splits={"train": train, "val": ["t0"], "test": ["t0", "t1"]},
    )
    for seed in (0, 1):
        source = with_validation_split(GenericLayoutSource(written.root, "A"), "train", 2, seed)
        val = {v.video_id for v in source.videos("val")}
        kept = {v.video_id for v in source.videos("train")}
        assert val == hand_carved(train, "A", 2, seed)
        assert val | kept == set(train) and not val & kept  # whole videos, moved not copied
        assert {v.video_id for v in source.videos("test")} == {"t0", "t1"}
        assert all(len(v.frames) == 3 for v in source.videos("val"))


def test_a_site_without_a_validation_split_of_its_own_is_a_clear_error(write_site):
    written = write_site("A", {"v0": 3, "t0": 3}, splits={"train": ["v0"], "test": ["t0"]})
    with pytest.raises(DataError, match=r"data\.val_split=train"):
        validation_videos(GenericLayoutSource(written.root, "A"), "dataset")
    carved = CarvedValidationSource(GenericLayoutSource(written.root, "A"), 1, 0)
    with pytest.raises(DataError, match=r"data\.val_videos=1"):
        carved.videos("val")  # the only training video cannot also be validation


def test_selection_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.val_every"):
        experiment(tmp_path, "selection.rule=val")
    with pytest.raises(ConfigError, match=r"selection\.held_out_site"):
        experiment(tmp_path, "selection.rule=cbe", "train.val_every=1")
    with pytest.raises(ConfigError, match="held_out_site='E'"):
        experiment(tmp_path, "selection.held_out_site=E", "train.val_every=1")


# -- one tiny federation with a held-out site ---------------------------------------------------


@pytest.fixture(scope="module")
def held_out_run(tmp_path_factory: pytest.TempPathFactory):
    """2 rounds, sites A-C train, D is held out (CBE), validation every round, SERQ off."""
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    cfg = experiment(
        root,
        "train.val_every=1",
        "selection.held_out_site=D",
        "selection.rule=cbe",
        "method.serq=false",
    )
    run_dir = tmp_path_factory.mktemp("runs") / "cbe"
    destinations: list[tuple[int, str]] = []
    site_of_node: dict[int, str] = {}
    original = InProcessGrid.__init__

    def recording(self, client_app, node_configs, *args, **kwargs):
        site_of_node.update({i: n["site-name"] for i, n in enumerate(node_configs, start=1)})

        def observe(direction, message):
            if direction == "down":
                destinations.append((message.metadata.dst_node_id, message.metadata.message_type))

        original(self, client_app, node_configs, *args, **kwargs, observer=observe)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InProcessGrid, "__init__", recording)
        final = run_training(cfg, run_dir, progress=False)
    return cfg, root, run_dir, final, [(site_of_node[n], kind) for n, kind in destinations]


def test_a_held_out_site_never_appears_in_a_training_round(held_out_run):
    cfg, _, run_dir, _, messages = held_out_run
    assert "D" not in cfg.data.federation
    for row in read_jsonl(run_dir / "participation.jsonl"):
        assert "D" not in row["participants"] and "D" not in row["missing"]
    assert {site for site, _ in messages} == {"A", "B", "C"}
    assert {row["site"] for row in read_jsonl(run_dir / "train.jsonl")} <= {"A", "B", "C", "server"}
    assert not site_state_dir(run_dir, "D").exists()


def test_validation_rounds_are_logged_with_split_val_and_their_models_kept(held_out_run):
    _, _, run_dir, final, _ = held_out_run
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "val"]
    assert sorted((r["round"], r["site"]) for r in rows) == [
        (t, s) for t in (1, 2) for s in ("A", "B", "C")
    ]
    for t in (1, 2):
        assert (run_dir / "selection" / f"shared_r{t:04d}.pt").exists()
        for site in "ABC":
            assert (site_state_dir(run_dir, site) / "selection" / f"personal_r{t:04d}.pt").exists()
    held = read_jsonl(run_dir / selection.HELD_OUT_ROWS)
    assert [(r["round"], r["site"], r["model"]) for r in held] == [
        (1, "D", "outfed"),
        (2, "D", "outfed"),
    ]
    assert final["selection"]["rule"] == "cbe"


def test_the_kept_snapshots_of_the_last_round_rebuild_the_runs_final_models(held_out_run):
    """Every tensor of v_k (and of the out-of-federation model) rebuilt from selection/ snapshots
    equals the one rebuilt from the run's final checkpoints (server.pt, sites' state_r0002.pt)."""
    cfg, _, run_dir, _, _ = held_out_run
    cpu = resolve_device("cpu")
    run = Run(run_dir, cfg)
    pairs = [(run.site_model(s, cpu, round=2), run.site_model(s, cpu)) for s in cfg.data.federation]
    pairs.append((run.outfed_model(cpu, round=2), run.outfed_model(cpu)))
    for kept, final in pairs:
        final_state = final.state_dict()
        for key, value in kept.state_dict().items():
            assert torch.equal(value, final_state[key]), key
    earlier = run.site_model("A", cpu, round=1).state_dict()
    assert any(not torch.equal(v, pairs[0][1].state_dict()[k]) for k, v in earlier.items())


def test_no_test_split_frame_or_label_is_read_while_rounds_are_selected(held_out_run, monkeypatch):
    cfg, root, run_dir, _, _ = held_out_run
    test_files = set()
    for site in ("A", "B", "C", "D", "E", "grasp"):
        for video in GenericLayoutSource(root, site).videos("test"):
            test_files.update(ref.path for ref in video.frames)
            test_files.update(ref.path for ref in video.labels.values())
    read = record_reads(monkeypatch)
    choices = selection.select_rounds(Run(run_dir, cfg), resolve_device("cpu"))
    assert read, "selection read no frame at all: the instrumentation is not in the path"
    assert not set(read) & test_files
    assert set(choices) == {"last", "val", "mixed", "cbe"}


def test_the_matrix_diagonal_equals_each_sites_own_result_of_the_same_checkpoints(
    held_out_run, tmp_path
):
    """The matrix and Site.evaluate (the per-site path of every round) on the same checkpoints.
    The 2-round models predict only background, so the copied run's classifier biases are centred
    (minus site A's mean logits on its first test frame): predictions then follow the features,
    and every (model, site) pair scores a different non-zero Dice."""
    cfg, _, run_dir, _, _ = held_out_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    model = Run(run, cfg).site_model("A", resolve_device("cpu"))
    test_a = open_site_data(cfg, "A", ("test",)).test
    indicator = method_of(cfg).indicators().get("A")
    _, _, _, logits = next(stream_test_clips(model, test_a, indicator, resolve_device("cpu"), 1))
    checkpoint = load_checkpoint(run / SERVER_CHECKPOINT)
    for site in cfg.data.federation:  # FedST scores each site's own gamma_k: centre every one
        path = site_state_file(site_state_dir(run, site), checkpoint["round"])
        state = load_checkpoint(path)
        state["shared"][classifier_bias(state["shared"])] -= logits.mean((1, 2))  # [K]
        torch.save(state, path)
    matrix = cross_site_matrix(run)
    assert matrix["models"] == ["A", "B", "C", "outfed"]
    assert matrix["sites"] == ["A", "B", "C", "E", "grasp"]
    received = {}  # FedST's site scores its own v_k = gamma_k U rho_k: gamma_g is not read
    diagonal = []
    for i, site in enumerate(cfg.data.federation):
        own = Site(site, cfg, site_state_dir(run, site), resolve_device("cpu"))
        summary = own.evaluate(received, checkpoint["round"])[site].summary
        assert matrix["dice"][i][i] == pytest.approx(summary["dice"], abs=1e-6)
        assert matrix["iou"][i][i] == pytest.approx(summary["iou"], abs=1e-6)
        diagonal.append(summary["dice"])
    assert len(set(diagonal)) == len(diagonal) and min(diagonal) > 0  # not a trivial check
    for i in range(len(diagonal)):  # models differ: a row swap would change the diagonal
        assert all(matrix["dice"][j][i] != matrix["dice"][i][i] for j in range(3) if j != i)


def test_the_matrix_of_a_selection_rule_evaluates_each_model_at_the_round_the_rule_chose(
    held_out_run, tmp_path, monkeypatch
):
    """A constructed selection.json: rule val picks A 1, B 2, C 1 and no out-of-federation round;
    cbe picks round 1 for all. The matrix rebuilds exactly those snapshots, one row per model."""
    _, _, run_dir, _, _ = held_out_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    choices = {
        "val": {"rule": "val", "sites": {"A": 1, "B": 2, "C": 1}, "outfed": None},
        "cbe": {"rule": "cbe", "sites": {"A": 1, "B": 1, "C": 1}, "outfed": 1},
    }
    (run / selection.SELECTION_FILE).write_text(json.dumps({"choices": choices}))
    rebuilt: list[tuple[str, int]] = []
    site_model, outfed_model = Run.site_model, Run.outfed_model

    def record_site(self, site, device, round=None):
        rebuilt.append((site, round))
        return site_model(self, site, device, round=round)

    def record_outfed(self, device, round=None):
        rebuilt.append(("outfed", round))
        return outfed_model(self, device, round=round)

    monkeypatch.setattr(Run, "site_model", record_site)
    monkeypatch.setattr(Run, "outfed_model", record_outfed)
    by_val = cross_site_matrix(run, "val")
    assert rebuilt == [("A", 1), ("B", 2), ("C", 1)]
    assert by_val["models"] == ["A", "B", "C"] and by_val["rounds"] == {"A": 1, "B": 2, "C": 1}
    rebuilt.clear()
    by_cbe = cross_site_matrix(run, "cbe")
    assert rebuilt == [("A", 1), ("B", 1), ("C", 1), ("outfed", 1)]
    assert by_cbe["models"] == ["A", "B", "C", "outfed"] and len(by_cbe["dice"]) == 4


# -- heterogeneity control ----------------------------------------------------------------------


def test_the_iid_control_deals_every_pooled_video_once_keeping_each_sites_video_counts(
    write_site,
):
    counts = {"A": {"train": 3, "val": 1, "test": 2}, "B": {"train": 1, "val": 1, "test": 1}}
    roots = {}
    for site, sizes in counts.items():
        ids = {sp: [f"{sp}{i}" for i in range(n)] for sp, n in sizes.items()}
        videos = {v: 4 for vs in ids.values() for v in vs}
        roots[site] = write_site(site, videos, splits=ids).root
    specs = {s: SiteSpec("generic", str(roots[s]), "nephrectomy") for s in counts}
    natural = DataConfig(sites=specs, federation=("A", "B"), out_of_federation=(), server=None)
    iid = dataclasses.replace(natural, partition="iid")
    with pytest.raises(ConfigError, match="iid_s0/A is missing"):
        iid.open("A")  # a site cannot build it alone (deployment)
    iid.build_iid()
    assert iid.build_iid() is not None  # idempotent
    foreign = []
    for split in ("train", "val", "test"):
        pooled = sorted(f"{s}__{v.video_id}" for s in counts for v in natural.open(s).videos(split))
        dealt = {s: iid.open(s).videos(split) for s in counts}
        assert sorted(v.video_id for vs in dealt.values() for v in vs) == pooled
        assert {s: len(vs) for s, vs in dealt.items()} == {s: counts[s][split] for s in counts}
        for site, videos in dealt.items():  # the same frames and labels as the owner's video
            source = iid.open(site)
            for video in videos:
                owner, video_id = video.video_id.split("__")
                foreign += [video.video_id] if owner != site else []
                own = {v.video_id: v for v in natural.open(owner).videos(split)}[video_id]
                assert [f.path.resolve() for f in video.frames] == [
                    f.path.resolve() for f in own.frames
                ]
                assert (
                    source.read_label(video.labels[0])
                    == natural.open(owner).read_label(own.labels[0])
                ).all()
    assert foreign, "the iid control dealt every site its own videos back"


def test_val_split_train_carves_only_sites_that_train_or_select(write_site):
    splits = {"train": ["v0", "v1", "v2"], "test": ["t0"]}
    for site in ("A", "E"):
        root = write_site(site, dict.fromkeys(["v0", "v1", "v2", "t0"], 3), splits=splits).root
    specs = {s: SiteSpec("generic", str(root), "nephrectomy") for s in ("A", "E")}
    data = DataConfig(
        sites=specs, federation=("A",), out_of_federation=("E",), server=None, val_split="train"
    )
    assert {v.video_id for v in data.open("A").videos("val")} == hand_carved(
        ["v0", "v1", "v2"], "A", 1, 0
    )
    assert len(data.open("A").videos("train")) == 2
    assert [v.video_id for v in data.open("E").videos("train")] == ["v0", "v1", "v2"]
