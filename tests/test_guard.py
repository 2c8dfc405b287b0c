"""Specifications of GEN-Guard's correction step (DAD, fedst/guard/; papers/002 Eq. 8-12).

Eq. 9 and Eq. 10-12 against hand computations on a few pixels; then, on the tiny federation with a
held-out site of tests/test_selection.py: DAD fits on validation splits only (no test frame or
label is read), saves each site's correction with the rounds rules mixed and cbe chose, its
corrected model streams what it predicts clip by clip, a missing correction or a run without the
needed snapshots is refused in one line, and the msf report shows the before / after rows.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedst import guard
from fedst.accel import resolve_device
from fedst.data.generic import GenericLayoutSource
from fedst.data.splits import validation_dataset
from fedst.errors import UserError
from fedst.guard import GuardConfig, GuardedNet, ResidualHeadGenerator
from fedst.infer import InferenceError, load_site_model
from fedst.methods import method_of
from fedst.report.selection import dad_rows, msf_report
from fedst.runs import Run
from fedst.runs import model_selection as selection
from fedst.scoring.evaluation import stream_test_clips
from tests.conftest import record_reads
from tests.test_federation import experiment
from tests.test_selection import held_out_run  # noqa: F401  (the tiny run with held-out D)

# -- Eq. 9: the corrected head ------------------------------------------------------------------

# Two pixels of one frame, D = 2 features, K = 2 classes.
FEATURES = [[1.0, 2.0], [0.0, -1.0]]  # E_CONV per pixel
HEAD_WEIGHT = [[0.5, -1.0], [2.0, 1.0]]  # W_CONV as the 1x1 conv stores it: [K, D]
HEAD_BIAS = [0.1, -0.2]
RESIDUAL_WEIGHT = [[0.1, 0.0], [0.0, -0.5]]  # W_res: [D, K]
RESIDUAL_BIAS = [1.0, 0.0]
# By hand: W_CONV^T + W_res = [[0.6, 2.0], [-1.0, 0.5]], b + b_res = [1.1, -0.2]
#   pixel 1, E = (1, 2):  class 0: 0.6 - 2.0 + 1.1 = -0.3; class 1: 2.0 + 1.0 - 0.2 = 2.8
#   pixel 2, E = (0, -1): class 0: 1.0 + 1.1 = 2.1;       class 1: -0.5 - 0.2 = -0.7
EXPECTED_LOGITS = [[-0.3, 2.8], [2.1, -0.7]]  # [pixel][class]


def features_tensor() -> torch.Tensor:
    """FEATURES as E_CONV [B=1, D=2, h=1, w=2]."""
    return torch.tensor(FEATURES).t().reshape(1, 2, 1, 2)


def assert_expected_pixels(logits: torch.Tensor) -> None:
    """logits [1, K, 1, 2] equal EXPECTED_LOGITS pixel by pixel."""
    per_pixel = logits.detach()[0, :, 0, :].t().numpy()  # [pixel, class]
    np.testing.assert_allclose(per_pixel, EXPECTED_LOGITS, atol=1e-6)


def test_eq9_adds_the_residual_to_the_students_head_at_every_pixel():
    logits = guard.corrected_logits(
        features_tensor(),
        torch.tensor(HEAD_WEIGHT),
        torch.tensor(HEAD_BIAS),
        torch.tensor(RESIDUAL_WEIGHT)[None],
        torch.tensor(RESIDUAL_BIAS)[None],
    )  # [1, K, 1, 2]
    assert_expected_pixels(logits)


class _StudentStub(nn.Module):
    """What GuardedNet reads of a student: ``prediction_head``, a 1x1 conv [K, D, 1, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.prediction_head = nn.Conv2d(2, 2, kernel_size=1)
        with torch.no_grad():
            self.prediction_head.weight.copy_(torch.tensor(HEAD_WEIGHT)[:, :, None, None])
            self.prediction_head.bias.copy_(torch.tensor(HEAD_BIAS))


def test_the_generator_output_is_read_as_w_res_then_b_res_and_applied_by_eq9():
    """R_pred's last layer set to output (W_res row-major, b_res) whatever the embedding: the
    corrected model's logits are the hand-computed ones."""
    generator = ResidualHeadGenerator(embed_dim=2, num_classes=2, dist_dim=3, hidden_dim=4)
    with torch.no_grad():
        generator.residual[-1].weight.zero_()
        generator.residual[-1].bias.copy_(
            torch.tensor([*np.ravel(RESIDUAL_WEIGHT), *RESIDUAL_BIAS])
        )
    model = GuardedNet(_StudentStub(), _StudentStub(), generator)
    teacher_features = torch.randn(1, 2, 1, 2)
    logits = model.correct(features_tensor(), teacher_features)
    assert_expected_pixels(logits)


def test_an_untrained_generator_leaves_the_students_head_unchanged():
    generator = ResidualHeadGenerator(embed_dim=2, num_classes=2, dist_dim=3, hidden_dim=4)
    model = GuardedNet(_StudentStub(), _StudentStub(), generator)
    features = torch.randn(3, 2, 4, 5)
    expected = model.student.prediction_head(features)
    assert torch.allclose(model.correct(features, torch.randn(3, 2, 4, 5)), expected, atol=1e-6)


# -- Eq. 10-12: the loss ------------------------------------------------------------------------

# Four pixels, K = 3 classes. Argmax student / teacher: 0/0 agree, 1/2 disagree, 2/2 agree,
# 0/1 disagree. The corrected model's argmax differs from the student's at pixel 0, so masks
# taken from y_final would differ from those of Eq. 11-12.
STUDENT = [[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.5, 1.5], [2.0, 1.0, -1.0]]
TEACHER = [[2.0, 0.0, 1.0], [0.5, 0.0, 1.0], [-1.0, 0.0, 2.0], [0.0, 1.5, 0.5]]
FINAL = [[0.0, 2.5, 0.5], [1.0, 0.0, 0.2], [0.3, -0.4, 0.9], [1.2, 0.8, 0.1]]


def as_logits(rows: list[list[float]]) -> torch.Tensor:
    """[pixel][class] -> [B=1, K, h=1, w=pixels]."""
    return torch.tensor(rows).t().reshape(1, len(rows[0]), 1, len(rows))


def hand_loss(t_dis: float, w_dis: float, t_agree: float, w_agree: float) -> tuple[float, ...]:
    """Eq. 10-12 in numpy, pixel by pixel: (total, L_agree, L_disagree), each / pixel count."""

    def softmax(x):
        e = np.exp(x - np.max(x))
        return e / e.sum()

    def kl(final, teacher, temperature):  # KL(teacher || final) at the temperature
        p = softmax(np.array(teacher) / temperature)
        q = softmax(np.array(final) / temperature)
        return float(np.sum(p * (np.log(p) - np.log(q))))

    def cosine_distance(a, b):
        a, b = np.array(a), np.array(b)
        return 1.0 - float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

    agree_sum = disagree_sum = 0.0
    for s, t, f in zip(STUDENT, TEACHER, FINAL, strict=True):
        if np.argmax(s) == np.argmax(t):
            agree_sum += kl(f, t, t_agree)
        else:
            disagree_sum += kl(f, t, t_dis) + cosine_distance(f, t)
    pixels = len(STUDENT)
    return (
        (w_agree * agree_sum + w_dis * disagree_sum) / pixels,
        agree_sum / pixels,
        disagree_sum / pixels,
    )


@pytest.mark.parametrize(
    "settings",
    [GuardConfig(), GuardConfig(temperature_disagree=3.0, weight_disagree=0.5, weight_agree=1.5)],
    ids=["paper", "other"],
)
def test_eq10_to_12_match_a_hand_computation_on_four_pixels(settings):
    loss = guard.dad_loss(as_logits(FINAL), as_logits(STUDENT), as_logits(TEACHER), settings)
    total, agree, disagree = hand_loss(
        settings.temperature_disagree,
        settings.weight_disagree,
        settings.temperature_agree,
        settings.weight_agree,
    )
    assert float(loss.agree) == pytest.approx(agree, rel=1e-5)
    assert float(loss.disagree) == pytest.approx(disagree, rel=1e-5)
    assert float(loss.total) == pytest.approx(total, rel=1e-5)
    assert loss.disagree_fraction == 0.5
    mask = guard.disagreement_mask(as_logits(STUDENT), as_logits(TEACHER))
    assert mask[0, 0].tolist() == [False, True, False, True]


def test_the_loss_is_zero_when_the_corrected_model_equals_the_teacher():
    teacher = as_logits(TEACHER)
    loss = guard.dad_loss(teacher.clone(), as_logits(STUDENT), teacher, GuardConfig())
    assert math.isclose(float(loss.total), 0.0, abs_tol=1e-6)


def test_the_dad_rows_give_means_and_the_worst_site_of_each_stage():
    def dice(before: float, after: float) -> dict:
        return {"before": {"dice": before}, "after": {"dice": after}}

    scores = {
        "rounds": {"student": 4, "teacher": 2},
        "in_federation": {"A": dice(80.0, 82.0), "B": dice(60.0, 70.0)},
        "held_out": {"D": dice(65.0, 58.0)},
        "out_of_federation": {"E": dice(10.0, 20.0), "grasp": dice(90.0, 91.0)},
    }
    before, after = dad_rows(Path("run"), scores)
    assert (before["in_fed_dice"], after["in_fed_dice"]) == (70.0, 76.0)
    assert (before["out_fed_mean"], after["out_fed_mean"]) == (50.0, 55.5)
    assert before["site_dice"] == {"D": 65.0, "E": 10.0, "grasp": 90.0}
    assert (before["worst_site"], before["worst_dice"]) == ("E", 10.0)
    assert (after["worst_site"], after["worst_dice"]) == ("E", 20.0)


# -- on the tiny federation with held-out site D ----------------------------------------------

EPOCHS = 2


@pytest.fixture(scope="module")
def guarded_run(held_out_run, tmp_path_factory):  # noqa: F811
    """DAD (2 epochs) at A, B, C (their v_k) and D (the out-of-federation model) on a copy of
    the run, with every frame and label read recorded."""
    cfg, root, run_dir, _, _ = held_out_run
    run = tmp_path_factory.mktemp("guarded") / "run"
    shutil.copytree(run_dir, run)
    with pytest.MonkeyPatch.context() as patch:
        read = record_reads(patch)
        written = guard.run_guard(Run(run, cfg), GuardConfig(epochs=EPOCHS))
    return cfg, root, run, written, read


def test_dad_reads_no_test_frame_or_label(guarded_run):
    _, root, _, _, read = guarded_run

    def files(sites: tuple[str, ...], split: str) -> set[Path]:
        paths = set()
        for site in sites:
            for video in GenericLayoutSource(root, site).videos(split):
                paths.update(ref.path for ref in video.frames)
                paths.update(ref.path for ref in video.labels.values())
        return paths

    test_files = files(("A", "B", "C", "D", "E", "grasp"), "test")
    val_files = files(("A", "B", "C", "D"), "val")  # E and grasp have no validation split
    assert read, "DAD read no frame at all: the instrumentation is not in the path"
    assert not set(read) & test_files
    assert set(read) <= val_files


def test_each_site_saves_its_correction_with_the_rounds_of_rules_mixed_and_cbe(guarded_run):
    cfg, _, run, written, _ = guarded_run
    choices = selection.choose(selection.validation_rows(run), cfg.data.federation, "D")
    rounds = (choices["mixed"].outfed, choices["cbe"].outfed)
    assert written == [guard.guard_file(run, s) for s in ("A", "B", "C", "D")]
    records = guard.saved_corrections(run)
    for site, record in records.items():
        plan = record["plan"]
        assert (plan["student_round"], plan["teacher_round"]) == rounds
        assert plan["model"] == ("outfed" if site == "D" else "personal")
        assert plan["supervised"] is (site != "D")  # the held-out site is zero-shot
        assert record["rules"] == {"student": "mixed", "teacher": "cbe"}
        assert 1 <= record["epochs_run"] <= EPOCHS and record["fit_frames"] >= 1
        assert record["stop_frames"] >= 1
        losses = [h["stop_loss"] for h in record["history"]]
        assert losses[record["best_epoch"]] == min(losses)


def test_the_corrected_model_streams_what_it_predicts_clip_by_clip(guarded_run):
    """evaluate_model / fedst.infer use the stream; it must give forward()'s Eq. 9 logits."""
    cfg, _, run, _, _ = guarded_run
    cpu = resolve_device("cpu")
    model = guard.load_guarded_model(Run(run, cfg), "A", cpu)
    assert any(v.abs().sum() > 0 for v in model.generator.residual[-1].state_dict().values())
    dataset = validation_dataset(cfg.data.open("A"), cfg.data.val_split, cfg.clip_config())
    indicator = method_of(cfg).indicators().get("A")
    streamed = list(stream_test_clips(model, dataset, indicator, cpu, max_frames=3))
    for index, (_, _, sample_id, logits) in enumerate(streamed):
        clip, _, expected_id = dataset[index]
        assert sample_id == expected_id
        with torch.no_grad():
            expected = model(clip[None], indicator)[0]
        assert torch.allclose(logits, expected, atol=1e-4)
    with torch.no_grad():
        student = model.student(clip[None], indicator)[0]
    assert not torch.allclose(student, expected, atol=1e-6)  # the correction changed something


def test_a_missing_correction_is_one_clear_line(guarded_run, tmp_path):
    _, _, run, _, _ = guarded_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(guard.guard_file(copy, "B").parent)
    with pytest.raises(InferenceError, match=r"python -m fedst\.guard .* --site B") as err:
        load_site_model(copy, "B", None, resolve_device("cpu"), guard="dad")
    assert "\n" not in str(err.value)
    load_site_model(copy, "A", None, resolve_device("cpu"), guard="dad")  # A's is still there
    _, outfed, _ = load_site_model(copy, "outfed", "E", resolve_device("cpu"), guard="dad")
    assert isinstance(outfed, GuardedNet)  # the held-out site D's correction
    shutil.rmtree(guard.guard_file(copy, "D").parent)
    with pytest.raises(InferenceError, match=r"--site D"):
        load_site_model(copy, "outfed", "E", resolve_device("cpu"), guard="dad")


@pytest.mark.parametrize(
    ("overrides", "missing"),
    [
        ((), "no validation snapshots (train.val_every) and no held-out site"),
        (("train.val_every=1",), "no held-out site (selection.held_out_site)"),
    ],
)
def test_a_run_without_the_snapshots_or_held_out_site_is_refused_in_one_line(
    tmp_path, overrides, missing, capsys
):
    cfg = experiment(tmp_path / "data", *overrides)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(cfg.to_json())
    with pytest.raises(UserError) as stopped:
        guard.main([str(run), "--no-progress"])
    message = str(stopped.value)
    assert "\n" not in message and missing in message
    assert "train.val_every=<k>" in message and "selection.held_out_site=<" in message


def test_settings_on_the_command_line_are_checked_before_the_run_is_read(tmp_path):
    with pytest.raises(UserError, match=r"unknown key\(s\) \['temperature'\]"):
        guard.main([str(tmp_path), "--set", "temperature=3"])
    with pytest.raises(UserError, match=r"guard.epochs=0: must be >= 1"):
        guard.main([str(tmp_path), "--set", "temperature_disagree=3", "--epochs", "0"])


def test_the_msf_report_shows_the_corrected_models_before_and_after(guarded_run, tmp_path):
    cfg, _, run, _, _ = guarded_run
    msf_report([run], tmp_path / "report")
    text = (tmp_path / "report" / "msf.md").read_text()
    scores = guard.guard_test_scores(Run(run, cfg), resolve_device("cpu"))  # cached by the report
    rounds = scores["rounds"]
    assert f"| run | mixed (student, round {rounds['student']}) |" in text
    assert f"| run | mixed + DAD (teacher: cbe round {rounds['teacher']}) |" in text
    assert "| D Dice | E Dice | grasp Dice | out-fed mean | worst site |" in text
    assert set(scores["in_federation"]) == {"A", "B", "C"} and set(scores["held_out"]) == {"D"}
    assert set(scores["out_of_federation"]) == {"E", "grasp"}
    by_eval_outfed = guard.evaluate_guarded_sites(Run(run, cfg), ["E"], resolve_device("cpu"))
    assert by_eval_outfed["E"]["dice"] == scores["out_of_federation"]["E"]["after"]["dice"]
    every = {**scores["in_federation"], **scores["held_out"], **scores["out_of_federation"]}
    worst = min(every, key=lambda s: every[s]["after"]["dice"])
    assert f"| {worst} {every[worst]['after']['dice']:.2f} |" in text
