"""Specification of inference on video: streaming evaluation, the `fedst.infer` command, ONNX export.

The trained run directory of these tests is written directly (config + server checkpoint + one
site state of a randomly initialised tiny model), as run_training would leave it after one round.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from conftest import draw_frame
from hydra import compose, initialize_config_dir

from fedst.cli import register_resolvers, split_config
from fedst.data.clips import (
    ClipConfig,
    ClipDataset,
    clip_frame_positions,
    normalize_frames,
    resize_frame,
)
from fedst.data.generic import GenericLayoutSource
from fedst.errors import UserError
from fedst.export import OnnxStreamer
from fedst.export import main as export_main
from fedst.infer import InferConfig, InferenceError, draw_legend, load_site_model, run_inference
from fedst.infer import main as infer_main
from fedst.methods import method_of
from fedst.model.network import NetworkConfig, build_network
from fedst.model.state import state_subset
from fedst.report.plots import PART_COLORS
from fedst.runs.layout import SERVER_CHECKPOINT, site_state_dir, site_state_file
from fedst.scoring.evaluation import evaluate_model, stream_test_clips
from fedst.storage import atomic_torch_save
from fedst.training import save_config

H, W = 32, 40
DIM = 16
TINY = NetworkConfig(indicator_dim=DIM, decoder_dim=32, drop_path_rate=0.0)
INDICATOR = torch.nn.functional.normalize(torch.arange(DIM, dtype=torch.float32), dim=0)


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def tiny_net(**overrides):
    torch.manual_seed(0)
    return build_network(dataclasses.replace(TINY, **overrides)).eval()


# -- evaluation through the streaming path ---------------------------------------------------------


@pytest.fixture
def labelled_video(write_site):
    """Site D, one 14-frame test video at 12 fps labelled every 2nd frame: clip frames 0.2 s apart
    are 2.4 frames apart, so the context offsets (3, 5, 8 frames back) are not a fixed stride and
    include unlabelled frames."""
    write_site("D", videos={"v1": 14}, size=(H, W), fps=12, label_every=2)
    source = GenericLayoutSource(write_site.args[0], "D")
    return ClipDataset(source, "test", ClipConfig(image_size=(H, W)))


def test_streaming_evaluation_gives_the_clip_forward_predictions_on_a_test_video(
    labelled_video,
):
    net = tiny_net()
    # clip_frame_positions at 12 fps, 0.2 s (hand check: frame 10 -> 2, 5, 7, 10)
    assert clip_frame_positions(labelled_video.videos[0].times, 10, 4, 0.2) == [2, 5, 7, 10]
    streamed = list(stream_test_clips(net, labelled_video, INDICATOR, torch.device("cpu")))
    assert [sid for _, _, sid, _ in streamed] == [
        labelled_video[i][2] for i in range(len(labelled_video))
    ]
    for index, (frame, mask, sample_id, logits) in enumerate(streamed):
        clip, expected_mask, _ = labelled_video[index]
        with torch.no_grad():
            expected = net(clip[None], INDICATOR)[0]  # [K, H, W], all 4 frames encoded
        assert torch.equal(mask, expected_mask), sample_id
        assert torch.equal(frame, clip[-1]), sample_id
        assert torch.allclose(logits, expected, atol=1e-5), sample_id
        assert torch.equal(logits.argmax(0), expected.argmax(0)), sample_id


def test_streaming_evaluation_encodes_each_needed_frame_once(labelled_video):
    net = tiny_net()
    calls = []
    net.encoder.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    evaluate_model(net, labelled_video, INDICATOR, torch.device("cpu"))
    # labelled 0, 2, ..., 12 (7 clips, 28 frames for the clip forward); by hand, their clips use
    # 12 -> 4, 7, 9; 10 -> 2, 5, 7; 8 -> 0, 3, 5; 6 -> 1, 3; 4 -> 1: frames 0..10 and 12, not 11
    assert calls == [1] * 12


# -- a trained run directory and a test video ------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
VIDEO_FPS = 12  # 0.2 s = 2.4 frames: the clip's earlier frames are 3, 5 and 8 frames back
VIDEO_SIZE = (48, 64)  # (H, W) of the video, not the network's 64x80 input
TEMPORAL_GAIN = 30.0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What run_training leaves after round 1 of the tiny experiment, written directly: config,
    server checkpoint (gamma) and every site's state (rho) of one randomly initialised model
    whose temporal module's output projection is scaled up, so that which earlier frames a clip
    uses changes the predicted labels."""
    register_resolvers()
    root = tmp_path_factory.mktemp("data")
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = split_config(compose("config", overrides=["experiment=tiny", f"data.root={root}"]))[0]
    run = tmp_path_factory.mktemp("runs") / "fedst"
    save_config(cfg, run)
    model = method_of(cfg).build_model()
    with torch.no_grad():
        for module in model.temporal.values():  # the decode head's block, or a stage's module
            getattr(module, "block", module).proj.weight.mul_(TEMPORAL_GAIN)
    partition = method_of(cfg).partition(model)
    atomic_torch_save(
        {
            "round": 1,
            "global_model": model.state_dict(),
            "shared_keys": list(partition.shared),
            "serq": None,
            "extra": {},
        },
        run / SERVER_CHECKPOINT,
    )
    for site in cfg.data.federation:
        state = {
            "personal": state_subset(model, partition.personal),
            "shared": state_subset(model, partition.shared),  # the site's own gamma_k
            "num_examples": 4,
        }
        atomic_torch_save(state, site_state_file(site_state_dir(run, site), 1))
    return run


def write_video(path: Path, num_frames: int, fps: float = VIDEO_FPS) -> list[np.ndarray]:
    """An mp4 of the conftest frames (instrument moving over tissue); returns its RGB frames as
    OpenCV decodes them back."""
    height, width = VIDEO_SIZE
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    for index in range(num_frames):
        writer.write(cv2.cvtColor(draw_frame(index, VIDEO_SIZE)[0], cv2.COLOR_RGB2BGR))
    writer.release()
    capture, frames = cv2.VideoCapture(str(path)), []
    while (item := capture.read())[0]:
        frames.append(cv2.cvtColor(item[1], cv2.COLOR_BGR2RGB))
    return frames


def test_infer_writes_an_overlay_video_with_every_frame_at_the_input_size(run_dir, tmp_path):
    decoded = write_video(tmp_path / "case.mp4", 12)
    assert len(decoded) == 12
    out = tmp_path / "out"
    summary = run_inference(
        InferConfig(
            run=str(run_dir),
            site="A",
            input=str(tmp_path / "case.mp4"),
            output=str(out),
            labels=True,
            progress=False,
        )
    )
    capture = cv2.VideoCapture(str(out / "overlay.mp4"))
    assert int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) == 12
    assert (capture.get(cv2.CAP_PROP_FRAME_HEIGHT), capture.get(cv2.CAP_PROP_FRAME_WIDTH)) == (
        48,
        64,
    )
    read_back = []
    while (item := capture.read())[0]:
        read_back.append(cv2.cvtColor(item[1], cv2.COLOR_BGR2RGB))
    assert len(read_back) == 12
    # the legend's first swatch (8x8 px at this height, from (4, 4)) is shaft blue in every frame
    shaft = np.array(PART_COLORS[1][1])
    for frame in read_back:
        assert np.abs(frame[6:10, 6:10].reshape(-1, 3).mean(0) - shaft).max() < 30
    labels = sorted((out / "labels").glob("*.png"))
    assert len(labels) == 12
    timing = (out / "timing.csv").read_text().splitlines()
    assert timing[0].split(",") == [
        "frame",
        "time_s",
        "read_ms",
        "network_ms",
        "write_ms",
        "total_ms",
    ]
    assert len(timing) == 13 and summary["frames"] == 12


@pytest.mark.parametrize("realtime", [False, True], ids=["as-fast-as-possible", "paced"])
def test_infer_reports_latency_percentiles_after_the_warm_up(run_dir, tmp_path, realtime):
    write_video(tmp_path / "case.mp4", 12)
    summary = run_inference(
        InferConfig(
            run=str(run_dir),
            site="A",
            input=str(tmp_path / "case.mp4"),
            output=str(tmp_path / "out"),
            progress=False,
            realtime=realtime,
            warmup_frames=2,
        )
    )
    assert summary["realtime"] is realtime and summary["warmup_frames"] == 2
    assert set(summary["latency_ms"]) == {"read", "network", "write", "total"}
    for values in summary["latency_ms"].values():
        assert list(values) == ["p50", "p90", "p99", "max"]
        assert 0 <= values["p50"] <= values["p90"] <= values["p99"] <= values["max"]
    rows = (tmp_path / "out" / "timing.csv").read_text().splitlines()[1:]
    network_ms = sorted(float(row.split(",")[3]) for row in rows[2:])  # after the warm-up
    assert summary["latency_ms"]["network"]["max"] == pytest.approx(network_ms[-1], abs=0.01)
    if realtime:  # every frame of the file was either handed over or dropped
        assert summary["frames"] + summary["dropped_frames"] == 12
    else:
        assert summary["frames"] == 12 and summary["dropped_frames"] is None


def test_realtime_pacing_of_a_camera_is_refused(run_dir, tmp_path):
    with pytest.raises(InferenceError, match="camera"):
        run_inference(InferConfig(run=str(run_dir), site="A", input="0", realtime=True))


def test_infer_label_maps_are_the_clip_forward_at_the_videos_own_frame_rate(run_dir, tmp_path):
    decoded = write_video(tmp_path / "case.mp4", 12)
    out = tmp_path / "out"
    run_inference(
        InferConfig(
            run=str(run_dir),
            site="B",
            input=str(tmp_path / "case.mp4"),
            output=str(out),
            labels=True,
            progress=False,
        )
    )
    cfg, model, indicator = load_site_model(run_dir, "B", None, torch.device("cpu"))
    times = [i / VIDEO_FPS for i in range(len(decoded))]
    for t in range(len(decoded)):
        positions = clip_frame_positions(times, t, 4, 0.2)
        frames = np.stack([resize_frame(decoded[p], cfg.clip.image_size) for p in positions])
        with torch.no_grad():
            logits = model(normalize_frames(frames)[None], indicator)  # [1, K, 64, 80]
        logits = torch.nn.functional.interpolate(logits, size=VIDEO_SIZE, mode="bilinear")
        expected = logits[0].argmax(0).numpy()
        written = cv2.imread(str(out / "labels" / f"{t:09d}.png"), cv2.IMREAD_UNCHANGED)
        assert written.shape == VIDEO_SIZE
        assert (written == expected).all(), f"frame {t} (clip frames {positions})"


def test_out_of_federation_model_needs_the_prompt_site_and_then_runs(run_dir, tmp_path):
    write_video(tmp_path / "case.mp4", 3)
    args = [f"run={run_dir}", "site=outfed", f"input={tmp_path / 'case.mp4'}", "progress=false"]
    with pytest.raises(UserError, match="add prompt_site=<one of"):
        infer_main([*args, f"output={tmp_path / 'no'}"])
    summary = run_inference(
        InferConfig(
            run=str(run_dir),
            site="outfed",
            prompt_site="E",
            input=str(tmp_path / "case.mp4"),
            output=str(tmp_path / "out"),
            progress=False,
        )
    )
    assert summary["frames"] == 3 and (tmp_path / "out" / "overlay.mp4").stat().st_size > 0


def test_legend_names_every_part_in_its_colour():
    image = np.zeros((240, 320, 3), np.uint8)
    draw_legend(image)
    for _, colour in PART_COLORS.values():
        assert (image == np.array(colour, np.uint8)).all(axis=2).sum() > 20


# -- bad input: one clear line each ----------------------------------------------------------------


def infer_error(run_dir: Path, tmp_path: Path, *args: str) -> str:
    with pytest.raises(UserError) as raised:
        infer_main([f"run={run_dir}", f"output={tmp_path / 'out'}", "progress=false", *args])
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_an_unreadable_video_is_one_line(run_dir, tmp_path):
    (tmp_path / "notes.mp4").write_bytes(b"this is not a video file" * 50)
    message = infer_error(run_dir, tmp_path, "site=A", f"input={tmp_path / 'notes.mp4'}")
    assert "cannot decode" in message and "notes.mp4" in message


def test_a_zero_length_file_is_one_line(run_dir, tmp_path):
    (tmp_path / "empty.mp4").touch()
    message = infer_error(run_dir, tmp_path, "site=A", f"input={tmp_path / 'empty.mp4'}")
    assert "empty file (0 bytes)" in message and "empty.mp4" in message


def test_a_frame_size_change_mid_stream_is_one_line(run_dir, tmp_path):
    folder = tmp_path / "frames"
    folder.mkdir()
    for index, size in enumerate([VIDEO_SIZE, VIDEO_SIZE, (40, 64)]):
        cv2.imwrite(str(folder / f"{index:04d}.png"), draw_frame(index, size)[0])
    message = infer_error(run_dir, tmp_path, "site=A", f"input={folder}", "fps=10")
    assert "frame 2 of" in message and "64x40" in message and "64x48" in message


def test_a_run_without_the_requested_site_is_one_line(run_dir, tmp_path):
    decoded_video = tmp_path / "case.mp4"
    write_video(decoded_video, 2)
    message = infer_error(run_dir, tmp_path, "site=Z", f"input={decoded_video}")
    assert "has no site 'Z'" in message and "['A', 'B', 'C', 'D']" in message


# -- export --------------------------------------------------------------------------------------

ONNX_ATOL = 1e-4
"""Largest |logit difference| allowed between ONNX Runtime and PyTorch (measured: ~2e-6)."""


def test_onnx_runtime_streaming_matches_pytorch_streaming(run_dir, tmp_path):
    out = tmp_path / "A.onnx"
    export_main([f"run={run_dir}", "site=A", "format=onnx", f"output={out}"])
    cfg, model, indicator = load_site_model(run_dir, "A", None, torch.device("cpu"))
    onnx_stream = OnnxStreamer(out, threads=1)
    torch_stream = model.stream(indicator, interval_s=cfg.clip.interval_s)
    generator = torch.Generator().manual_seed(0)
    for index in range(10):  # past the 0.6 s span at 12 fps, so the cache is pruned and reused
        frame = torch.randn(1, 3, *cfg.clip.image_size, generator=generator)
        expected = torch_stream.step(frame, index / VIDEO_FPS)
        got = torch.from_numpy(onnx_stream.step(frame.numpy(), index / VIDEO_FPS))
        assert got.shape == expected.shape
        assert (got - expected).abs().max() <= ONNX_ATOL, f"frame {index}"
