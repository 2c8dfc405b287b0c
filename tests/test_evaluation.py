"""Specifications of evaluation: unscored classes travel as absent, distances in native pixels."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from flwr.app import MessageType

from fedst import report
from fedst.app.server_app import _metrics_row
from fedst.cli import compose_experiment
from fedst.methods import Method
from fedst.training import _scalars
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
    """The streaming interface of FedSTNet (``uses_temporal``, ``stream(...).step``) for the
    single-frame test models below: each step is ``forward`` on a one-frame clip."""

    def uses_temporal(self, num_frames: int, use_temporal: bool = True) -> bool:
        return False

    def stream(self, indicator=None, frame_stride: int = 1, **_) -> _FrameByFrame:
        return self

    def step(self, frame: torch.Tensor, time_s=None, *, predict: bool = True):
        return self(frame[:, None]) if predict else None  # [B, 3, H, W] -> [B, 1, 3, H, W]


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

    row = _metrics_row(reply, 1)
    assert row["per_class"]["jaw"]["dice"] is None
    assert row["per_class"]["shaft"]["dice"] is not None
    run = {
        "method": "fedst",
        "seed": 0,
        "experiment": "tiny",
        "final": {"sites": {"A": _scalars(row)}},
    }
    table = report.per_class_table([run, {**run, "seed": 1}])
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
    from fedst.federation.evaluation import evaluate_model

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
