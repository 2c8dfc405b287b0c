"""Specification of `fedst.infer` when the user errs (issue 36): a file that is not a video stops
with one line, a failed run leaves its output folder as it was, --help reads as plain text, and a
DAD-corrected model is recorded as such.

The trained run directory and the video writer are tests/test_infer.py's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import cv2
import pytest
from conftest import draw_frame
from test_infer import VIDEO_SIZE, run_dir, write_video  # noqa: F401  (the tiny trained run)

from fedst.export import ExportConfig
from fedst.export import main as export_main
from fedst.infer import InferConfig, InferenceError, run_inference
from fedst.infer import main as infer_main

NOTES = "Meeting notes: the federated run on site A finished after 8 rounds, Dice 72.5.\n" * 200
"""A plain text file long enough that FFmpeg's "tty" demuxer opens a .txt of it (as 640x400 frames)."""
ANSI_ART = b"\xdb\xdb\xb2\xb1\xb0 FEDST \xb0\xb1\xb2\xdb\xdb\r\n" * 300
"""Code-page-437 block characters: not UTF-8, but FFmpeg's tty demuxer draws an .nfo of them."""


def run_on(run: Path, tmp_path: Path, source: Path, **keys) -> dict:
    config = InferConfig(
        run=str(run), site="A", input=str(source), output=str(tmp_path / "out"), progress=False
    )
    return run_inference(dataclasses.replace(config, **keys))


def files_under(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder``, hidden ones included: relative path -> content."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def frame_folder(folder: Path, sizes: list[tuple[int, int]]) -> Path:
    folder.mkdir()
    for index, size in enumerate(sizes):
        cv2.imwrite(str(folder / f"{index:04d}.png"), draw_frame(index, size)[0])
    return folder


# -- a file that is not a video ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("notes.txt", NOTES.encode()),  # FFmpeg's tty demuxer would draw it as 640x400 frames
        ("notes.mp4", NOTES.encode()),  # a text file renamed .mp4
        ("notes.nfo", ANSI_ART),  # not UTF-8: refused by the codec FFmpeg reports ("ansi")
        ("notes.idf", bytes(range(256)) * 80),  # FFmpeg's bintext demuxer would draw it
    ],
)
def test_a_text_file_is_refused_in_one_line_and_leaves_no_output(run_dir, tmp_path, name, content):  # noqa: F811
    source = tmp_path / name
    source.write_bytes(content)
    with pytest.raises(InferenceError) as error:
        run_on(run_dir, tmp_path, source)
    message = str(error.value)
    assert "\n" not in message and str(source) in message
    assert "is a text" in message.replace(str(source), "<input>")  # says what the file is
    assert not (tmp_path / "out").exists()


def test_a_real_small_video_still_works_and_only_its_finished_outputs_are_left(run_dir, tmp_path):  # noqa: F811
    write_video(tmp_path / "case.mp4", 4)
    summary = run_on(run_dir, tmp_path, tmp_path / "case.mp4", labels=True)
    out = tmp_path / "out"
    assert sorted(files_under(out)) == [
        *(f"labels/{i:09d}.png" for i in range(4)),
        "overlay.mp4",
        "summary.json",
        "timing.csv",
    ]
    capture = cv2.VideoCapture(str(out / "overlay.mp4"))
    assert int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) == 4
    assert summary["frames"] == 4 and summary["guard"] is None
    assert json.loads((out / "summary.json").read_text()) == summary


# -- a failure part-way leaves the folder as it was -------------------------------------------------


def test_a_frame_size_change_mid_stream_leaves_no_overlay_or_other_output(run_dir, tmp_path):  # noqa: F811
    frames = frame_folder(tmp_path / "frames", [VIDEO_SIZE, VIDEO_SIZE, (40, 64)])
    with pytest.raises(
        InferenceError, match=r"frame 2 of .* is 64x40 but the stream started at 64x48"
    ):
        run_on(run_dir, tmp_path, frames, fps=10, labels=True)
    assert not (
        tmp_path / "out"
    ).exists()  # overlay.mp4 and two label maps were written, then removed


def test_a_failed_rerun_leaves_the_earlier_outputs_as_they_were(run_dir, tmp_path):  # noqa: F811
    write_video(tmp_path / "case.mp4", 3)
    run_on(run_dir, tmp_path, tmp_path / "case.mp4", labels=True)
    before = files_under(tmp_path / "out")
    frames = frame_folder(tmp_path / "frames", [VIDEO_SIZE, (40, 64)])
    with pytest.raises(InferenceError, match="frame 1 of"):
        run_on(run_dir, tmp_path, frames, fps=10, labels=True)
    assert files_under(tmp_path / "out") == before


def test_a_rerun_replaces_the_label_maps_instead_of_mixing_them(run_dir, tmp_path):  # noqa: F811
    write_video(tmp_path / "long.mp4", 4)
    write_video(tmp_path / "short.mp4", 2)
    run_on(run_dir, tmp_path, tmp_path / "long.mp4", labels=True)
    run_on(run_dir, tmp_path, tmp_path / "short.mp4", labels=True)
    labels = sorted(p.name for p in (tmp_path / "out" / "labels").iterdir())
    assert labels == ["000000000.png", "000000001.png"]


# -- --help -------------------------------------------------------------------------------------

RST_MARKUP = re.compile(r"``|:[a-z]+:`|::$", re.MULTILINE)
"""reStructuredText a terminal would show raw: inline literals, roles, literal-block markers."""


@pytest.mark.parametrize(
    ("main", "config", "prog"),
    [
        (infer_main, InferConfig, "python -m fedst.infer"),
        (export_main, ExportConfig, "python -m fedst.export"),
    ],
    ids=["infer", "export"],
)
def test_help_is_plain_text_and_explains_every_key(main, config, prog, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code in (0, None)
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {prog} run=RUN site=SITE")
    assert not RST_MARKUP.findall(text), RST_MARKUP.findall(text)
    lines = text.splitlines()
    for field in config.__dataclass_fields__:
        (row,) = [i for i, line in enumerate(lines) if line.startswith(f"  {field}=")]
        assert lines[row + 1].startswith("      ") and len(lines[row + 1].split()) >= 3, field


# -- guard=dad ----------------------------------------------------------------------------------


def test_the_dad_corrected_model_is_named_in_the_log_and_summary(
    run_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
    caplog,
):
    """The correction itself needs a run with validation snapshots (tests/test_guard.py); here
    the site's own model stands in for it, so only what infer records is under test."""
    loaded = []

    def stand_in(run, site, device):
        loaded.append(site)
        return run.site_model(site, device)

    monkeypatch.setattr("fedst.guard.load_guarded_model", stand_in)
    write_video(tmp_path / "case.mp4", 2)
    with caplog.at_level(logging.INFO, logger="fedst.infer"):
        summary = run_on(run_dir, tmp_path, tmp_path / "case.mp4", site="B", guard="dad")
    correction = run_dir / "sites" / "B" / "guard" / "dad.pt"  # docs: <site state dir>/guard/dad.pt
    assert loaded == ["B"]
    assert summary["guard"] == {"name": "dad", "corrected_at": "B", "correction": str(correction)}
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["guard"] == summary["guard"]
    assert any(
        "DAD" in r.getMessage() and str(correction) in r.getMessage() for r in caplog.records
    )
