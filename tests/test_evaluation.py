"""Specifications of evaluation: unscored classes travel as absent, distances in native pixels."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from flwr.app import MessageType

from fedst.app.reply_logs import metrics_row
from fedst.cli import compose_experiment
from fedst.methods import Method
from fedst.report import tables
from fedst.runs.final import summary_scalars
from tests.conftest import reply_of_one_site, write_generic_site

JAW = 3


def _site_without_jaw(root: Path, name: str) -> None:
    """A generic site whose labels never contain the jaw (its pixels relabelled as wrist)."""
    written = write_generic_site(root, name, videos={"v1": 4}, size=(32, 40))
    for masks in written.masks.values():
        for path in masks.values():
            label = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
            label[label == JAW] = 2
            cv2.imwrite(str(path), label)


class _FrameByFrame:
    """The streaming interface of FedSTNet (``uses_temporal``, ``stream(...).step`` and
    ``.step_frames``) for the single-frame test models below: each step is ``forward`` on
    one-frame clips."""

    def uses_temporal(self, num_frames: int, use_temporal: bool = True) -> bool:
        return False

    def stream(self, indicator=None, frame_stride: int = 1, **_) -> _FrameByFrame:
        return self

    def step(self, frame: torch.Tensor, time_s=None, *, predict: bool = True):
        return self(frame[:, None]) if predict else None  # [B, 3, H, W] -> [B, 1, 3, H, W]

    def step_frames(self, frames: torch.Tensor, times_s=None, predict=None):
        predict = [True] * len(frames) if predict is None else predict
        kept = frames[[i for i, p in enumerate(predict) if p]]  # [M, 3, H, W]
        return self(kept[:, None]) if len(kept) else None


class _NoJawModel(_FrameByFrame, torch.nn.Module):
    """Predicts shaft everywhere: never the jaw (logits [B, 4, H, W])."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))  # the site's optimizer needs one

    def forward(self, clips: torch.Tensor, indicator=None) -> torch.Tensor:
        batch, _, _, height, width = clips.shape
        logits = torch.zeros(batch, 4, height, width)
        logits[:, 1] = 1.0
        return logits


def test_a_site_without_jaw_is_evaluated_through_the_client_app_and_jaw_shows_unscored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    _site_without_jaw(tmp_path, "A")
    cfg, _ = compose_experiment(
        [
            "experiment=tiny",
            f"data.root={tmp_path}",
            "data.procedural=null",
            "data.federation=[A]",
            "data.out_of_federation=[]",
            "data.server=null",
            "method=fedavg",  # nothing personalized: the stand-in model's one tensor is shared
            "train.eval_max_frames=null",
        ]
    )
    monkeypatch.setattr(Method, "build_model", lambda _method: _NoJawModel())
    reply = reply_of_one_site(cfg, tmp_path, MessageType.EVALUATE, **{"server-round": 0})
    assert not reply.has_error(), reply.error.reason
    sent = dict(reply.content["metrics"])
    assert "jaw/dice" not in sent and "jaw/hd95" not in sent  # absent, not a number
    assert sent["jaw/frames"] == 0
    assert sent["shaft/frames"] == 4  # every frame has a shaft

    row = metrics_row(reply, 1)
    assert row["per_class"]["jaw"]["dice"] is None
    assert row["per_class"]["shaft"]["dice"] is not None
    run = {
        "method": "fedst",
        "seed": 0,
        "experiment": "tiny",
        "final": {"sites": {"A": summary_scalars(row)}},
    }
    table = tables.per_class_table([run, {**run, "seed": 1}])
    cells = dict(zip([c.header for c in table.columns], table.rows["fedst"], strict=True))
    assert cells["A jaw"] is None and cells["A shaft"] is not None
    markdown_row = table.to_markdown().splitlines()[-1].split("|")
    headers = table.to_markdown().splitlines()[2].split("|")
    assert markdown_row[headers.index(" A jaw ")].strip() == "n/a"


# -- distances at native label resolution -----------------------------------------------------------

GT_ROW, SHIFT, COL0, COL1 = 5, 3, 4, 14  # at the network input (16 x 20); native is twice that


class _LineModel(_FrameByFrame, torch.nn.Module):
    """Logits [B, 2, 16, 20]: class 1 (10) on input row GT_ROW + SHIFT, columns COL0..COL1; class 0
    is 5 everywhere. Bilinear x2 upsampling turns the line into native rows 2r and 2r + 1."""

    def forward(self, clips: torch.Tensor, indicator=None) -> torch.Tensor:
        batch, _, _, height, width = clips.shape
        logits = torch.zeros(batch, 4, height, width)
        logits[:, 0] = 5.0
        logits[:, 1, GT_ROW + SHIFT, COL0 : COL1 + 1] = 10.0
        return logits


def test_hd95_and_assd_are_in_native_label_pixels(tmp_path: Path):
    """Native label 32 x 40: a 2-row band (rows 2g, 2g+1); prediction: the same band 2 * SHIFT rows
    lower. Hand derivation: every edge pixel of one band is 2s - 1 (nearer row) or 2s (farther
    row) from the other band, half and half, both directions. HD95 = 2s = 6 px, ASSD = 2s - 1/2 =
    5.5 px. At the 16 x 20 network input the same geometry would give 3 and 3."""
    from fedst.data.clips import ClipConfig, ClipDataset
    from fedst.data.generic import GenericLayoutSource
    from fedst.scoring.evaluation import evaluate_model

    written = write_generic_site(tmp_path, "N", videos={"v1": 2}, size=(32, 40))
    label = np.zeros((32, 40), np.uint8)
    label[2 * GT_ROW : 2 * GT_ROW + 2, 2 * COL0 : 2 * COL1 + 2] = 1
    for path in written.masks["v1"].values():
        cv2.imwrite(str(path), label)
    dataset = ClipDataset(
        GenericLayoutSource(tmp_path, "N"), "test", ClipConfig(num_frames=1, image_size=(16, 20))
    )
    result = evaluate_model(_LineModel(), dataset, None, torch.device("cpu"))
    shaft = result.summary["per_class"]["shaft"]
    assert shaft["frames"] == 2
    assert shaft["dice"] == 0.0
    assert shaft["hd95"] == pytest.approx(2 * SHIFT)
    assert shaft["assd"] == pytest.approx(2 * SHIFT - 0.5)


# -- batched evaluation ----------------------------------------------------------------------------


def _centred_tiny_net(dataset):
    """The tiny temporal network of tests/test_infer.py with its classifier bias centred on the
    first sample's mean logits, so its predictions spread over every class (non-trivial scores)."""
    from tests.test_infer import INDICATOR, tiny_net

    net = tiny_net()
    with torch.no_grad():
        clip, _, _ = dataset[0]
        net.decoder.head.bias -= net(clip[None], INDICATOR)[0].mean((1, 2))
    return net, INDICATOR


def _per_sample_reference(net, dataset, indicator, distances: bool = True):
    """The evaluation before batching and before the pixel counts, written out: for every sample
    the full clip forward, the logits upsampled to the native label, the argmax scored frame by
    frame on the host by MONAI (fedst.scoring.metrics.reference_batch_metrics)."""
    from fedst.scoring.metrics import SegmentationMeter, reference_batch_metrics

    meter = SegmentationMeter()
    for index in range(len(dataset)):
        clip, _, sample_id = dataset[index]
        with torch.no_grad():
            logits = net(clip[None], indicator)  # [1, K, h, w]
        label = torch.from_numpy(dataset.native_label(sample_id).astype(np.int64))
        native = torch.nn.functional.interpolate(
            logits, size=tuple(label.shape), mode="bilinear", align_corners=False
        )
        scores = reference_batch_metrics(native.argmax(1), label[None], distances=distances)
        meter.add_scores(scores, [sample_id])
    return meter.summary()


def _assert_summaries_close(actual: dict, expected: dict, tol: float = 1e-5) -> None:
    assert actual["num_frames"] == expected["num_frames"]
    for metric in ("dice", "iou", "hd95", "assd"):
        assert actual[metric] == pytest.approx(expected[metric], abs=tol), metric
    assert actual["per_class"].keys() == expected["per_class"].keys()
    for name, values in expected["per_class"].items():
        for key, value in values.items():
            assert actual["per_class"][name][key] == pytest.approx(value, abs=tol), (name, key)


def test_batched_evaluation_equals_the_per_sample_clip_evaluation(write_site):
    """Three test videos at 12 fps labelled every 2nd frame, native 48 x 64, network input
    32 x 40: batches of 4 frames span video boundaries and hold unlabelled context frames; one
    loader worker sends uint8 frames. Scores equal the clip-by-clip path's to 1e-5."""
    from fedst.data.clips import ClipConfig, ClipDataset
    from fedst.data.generic import GenericLayoutSource
    from fedst.scoring.evaluation import evaluate_model

    write_site("P", videos={"v1": 9, "v2": 14, "v3": 5}, size=(48, 64), fps=12, label_every=2)
    source = GenericLayoutSource(write_site.args[0], "P")
    dataset = ClipDataset(source, "test", ClipConfig(image_size=(32, 40)))
    net, indicator = _centred_tiny_net(dataset)
    expected = _per_sample_reference(net, dataset, indicator)
    assert expected["dice"] not in (None, 0.0, 100.0)  # the scores are not trivial
    cpu = torch.device("cpu")
    frame_by_frame = evaluate_model(net, dataset, indicator, cpu).summary
    batched = evaluate_model(net, dataset, indicator, cpu, batch_size=4, num_workers=1).summary
    _assert_summaries_close(frame_by_frame, expected)
    _assert_summaries_close(batched, expected)


def test_without_distances_the_overlap_scores_are_unchanged_and_distances_absent(write_site):
    from fedst.data.clips import ClipConfig, ClipDataset
    from fedst.data.generic import GenericLayoutSource
    from fedst.scoring.evaluation import evaluate_model

    write_site("P", videos={"v1": 6}, size=(48, 64), fps=12, label_every=2)
    dataset = ClipDataset(
        GenericLayoutSource(write_site.args[0], "P"), "test", ClipConfig(image_size=(32, 40))
    )
    net, indicator = _centred_tiny_net(dataset)
    cpu = torch.device("cpu")
    full = evaluate_model(net, dataset, indicator, cpu, batch_size=3).summary
    overlap = evaluate_model(net, dataset, indicator, cpu, batch_size=3, distances=False).summary
    assert overlap["dice"] == full["dice"] and overlap["iou"] == full["iou"]
    assert overlap["hd95"] is None and overlap["assd"] is None
    assert full["hd95"] is not None


# -- scoring on the device -------------------------------------------------------------------------


def _small_site(write_site):
    from fedst.data.clips import ClipConfig, ClipDataset
    from fedst.data.generic import GenericLayoutSource

    write_site("P", videos={"v1": 7, "v2": 6}, size=(48, 64), fps=12, label_every=2)
    dataset = ClipDataset(
        GenericLayoutSource(write_site.args[0], "P"), "test", ClipConfig(image_size=(32, 40))
    )
    return dataset, *_centred_tiny_net(dataset)


def test_counts_reach_the_host_once_per_flush_and_distances_only_when_asked(
    write_site, monkeypatch
):
    """7 labelled frames, counts flushed every 3: 3 copies to the host (3 + 3 + 1 frames), the
    MONAI reference's Dice / IoU; without distances no class map is scored for distances."""
    from fedst.scoring import evaluation

    dataset, net, indicator = _small_site(write_site)
    copies: list[int] = []
    real_scores = evaluation.overlap_scores

    def counting_scores(counts, sample_ids=None):
        copies.append(len(counts))
        return real_scores(counts, sample_ids)

    def no_distances(*args, **kwargs):
        raise AssertionError("distance_metrics called in an evaluation without distances")

    monkeypatch.setattr(evaluation, "COUNT_FLUSH_FRAMES", 3)
    monkeypatch.setattr(evaluation, "overlap_scores", counting_scores)
    monkeypatch.setattr(evaluation, "distance_metrics", no_distances)
    summary = evaluation.evaluate_model(
        net, dataset, indicator, torch.device("cpu"), batch_size=4, distances=False
    ).summary
    assert summary["num_frames"] == len(dataset) == 7
    assert copies == [3, 3, 1]
    expected = _per_sample_reference(net, dataset, indicator, distances=False)
    assert summary["dice"] == pytest.approx(expected["dice"], abs=1e-5)
    assert summary["iou"] == pytest.approx(expected["iou"], abs=1e-5)
    assert summary["hd95"] is None


def test_evaluation_forward_runs_under_autocast_and_scoring_outside_it(write_site, monkeypatch):
    """amp_dtype reaches fedst.accel.resolve_precision; the network's passes run under its
    autocast (bf16 autocast exists on the CPU too, so the logits come out bf16 here), while the
    consumer of the predictions (upsampling, counts) runs outside it."""
    from fedst import accel
    from fedst.scoring import evaluation

    dataset, net, indicator = _small_site(write_site)
    asked: list[tuple[str, str]] = []

    def cpu_bf16(amp_dtype, device, bf16_supported=None):
        asked.append((amp_dtype, device.type))
        return accel.Precision("cpu", torch.bfloat16)

    monkeypatch.setattr(evaluation, "resolve_precision", cpu_bf16)
    predictions = evaluation.predict_test_frames(
        net, dataset, indicator, torch.device("cpu"), batch_size=2, amp_dtype="bf16"
    )
    for prediction in predictions:
        assert prediction.logits.dtype == torch.bfloat16
        assert not torch.is_autocast_enabled("cpu")
    assert asked == [("bf16", "cpu")]
    summary = evaluation.evaluate_model(
        net, dataset, indicator, torch.device("cpu"), amp_dtype="fp16", distances=False
    ).summary
    assert asked[-1] == ("fp16", "cpu") and summary["dice"] is not None


def test_the_config_passes_its_amp_dtype_to_evaluation():
    from fedst.experiment import TrainConfig

    assert TrainConfig(amp_dtype="bf16").evaluation_options(1)["amp_dtype"] == "bf16"
    assert TrainConfig(amp_dtype="none").evaluation_options()["amp_dtype"] == "none"


# -- the network's class count ---------------------------------------------------------------------


class _PaletteModel(_FrameByFrame, torch.nn.Module):
    """Recognises the test frames' part colours (tests/conftest.py PART_COLOURS) exactly and
    predicts ``classes[part]`` there, background elsewhere: logits [B, num_classes, H, W]."""

    def __init__(self, num_classes: int, classes: dict[int, int]) -> None:
        super().__init__()
        self.num_classes, self.classes = num_classes, classes

    def forward(self, clips: torch.Tensor, indicator=None) -> torch.Tensor:
        from fedst.data.clips import IMAGENET_MEAN, IMAGENET_STD
        from tests.conftest import PART_COLOURS

        frame = clips[:, -1]  # [B, 3, H, W] normalised
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        rgb = (frame * std + mean) * 255
        batch, _, height, width = frame.shape
        logits = torch.zeros(batch, self.num_classes, height, width)
        for part, cls in self.classes.items():
            colour = torch.tensor(PART_COLOURS[part], dtype=torch.float32).view(1, 3, 1, 1)
            logits[:, cls] += 10.0 * ((rgb - colour).abs().amax(1) < 2)
        logits[:, 0] += 5.0
        return logits


def _part_site(root: Path, name: str, jaw_as_wrist: bool):
    """A 4-frame test site at the network's input size; labels 0..2 when ``jaw_as_wrist``."""
    from fedst.data.clips import ClipConfig, ClipDataset
    from fedst.data.generic import GenericLayoutSource

    if jaw_as_wrist:
        _site_without_jaw(root, name)
    else:
        write_generic_site(root, name, videos={"v1": 4}, size=(32, 40))
    config = ClipConfig(num_frames=1, image_size=(32, 40))  # native size: colours stay exact
    return ClipDataset(GenericLayoutSource(root, name), "test", config)


def test_a_three_class_network_is_scored_on_its_three_classes(tmp_path: Path):
    """Labels 0..2 (jaw relabelled wrist); the network has 3 classes and predicts shaft -> 1,
    wrist and jaw colours -> 2: both parts perfect in each of the 4 frames (by hand: Dice 100 %,
    distances 0), and no fourth class reported."""
    from fedst.scoring.evaluation import evaluate_model

    dataset = _part_site(tmp_path, "T", jaw_as_wrist=True)
    model = _PaletteModel(3, {1: 1, 2: 2, 3: 2})
    summary = evaluate_model(model, dataset, None, torch.device("cpu"), batch_size=2).summary
    assert set(summary["per_class"]) == {"class_1", "class_2"}
    for name in ("class_1", "class_2"):
        assert summary["per_class"][name]["frames"] == 4
        assert summary["per_class"][name]["dice"] == pytest.approx(100.0)
        assert summary["per_class"][name]["hd95"] == pytest.approx(0.0)
    assert summary["dice"] == pytest.approx(100.0)


def test_a_six_class_network_is_scored_on_its_six_classes(tmp_path: Path):
    """Labels 0..3; the 6-class network predicts shaft -> 1, wrist -> 2, jaw -> 5. By hand, per
    frame: classes 1, 2 perfect; class 3 in the label only and class 5 in the prediction only
    (Dice 0, distances = the 32 x 40 diagonal); class 4 absent from both (not scored). Overall
    Dice = mean(100, 100, 0, 0) = 50 %."""
    from fedst.scoring.evaluation import evaluate_model

    dataset = _part_site(tmp_path, "S", jaw_as_wrist=False)
    model = _PaletteModel(6, {1: 1, 2: 2, 3: 5})
    summary = evaluate_model(model, dataset, None, torch.device("cpu"), batch_size=3).summary
    per_class = summary["per_class"]
    assert set(per_class) == {f"class_{c}" for c in range(1, 6)}
    assert per_class["class_1"]["dice"] == pytest.approx(100.0)
    assert per_class["class_2"]["dice"] == pytest.approx(100.0)
    diagonal = float(np.hypot(32, 40))
    for name in ("class_3", "class_5"):
        assert per_class[name]["frames"] == 4
        assert per_class[name]["dice"] == 0.0
        assert per_class[name]["hd95"] == pytest.approx(diagonal)
    assert per_class["class_4"]["frames"] == 0
    assert summary["dice"] == pytest.approx(50.0)
