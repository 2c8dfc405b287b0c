"""Specifications of evaluation: unscored classes travel as absent, distances in native pixels."""

from __future__ import annotations

from pathlib import Path

import cv2
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from fedst import report
from fedst.app.client_app import app as client_app
from fedst.app.client_app import release_sites
from fedst.app.inprocess import InProcessGrid
from fedst.app.server_app import _metrics_row
from fedst.cli import compose_experiment
from fedst.training import _scalars
from tests.conftest import write_generic_site

JAW = 3


def _site_without_jaw(root: Path, name: str) -> None:
    """A generic site whose labels never contain the jaw (its pixels relabelled as wrist)."""
    written = write_generic_site(root, name, videos={"v1": 4}, size=(32, 40))
    for masks in written.masks.values():
        for path in masks.values():
            label = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
            label[label == JAW] = 2
            cv2.imwrite(str(path), label)


class _NoJawModel(torch.nn.Module):
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
            "method.serq=false",
            "train.eval_max_frames=null",
        ]
    )
    monkeypatch.setattr("fedst.federation.site.build_model", lambda _cfg: _NoJawModel())
    monkeypatch.setattr("fedst.federation.site.partition_of", lambda *a: None)
    grid = InProcessGrid(client_app, [{"partition-id": 0}])
    config = {"experiment": cfg.to_json(), "run-dir": str(tmp_path / "run"), "server-round": 0}
    message = Message(
        RecordDict({"arrays": ArrayRecord({}), "config": ConfigRecord(config)}),
        dst_node_id=1,
        message_type=MessageType.EVALUATE,
        group_id="0",
    )
    try:
        (reply,) = grid.send_and_receive([message])
    finally:
        release_sites()
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
