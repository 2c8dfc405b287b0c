"""Specification of inference on video: streaming evaluation, the `fedst.infer` command, ONNX export.

The trained run directory of these tests is written directly (config + server checkpoint + one
site state of a randomly initialised tiny model), as run_training would leave it after one round.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedst.data.clips import ClipConfig, ClipDataset, clip_frame_positions
from fedst.data.generic import GenericLayoutSource
from fedst.federation.evaluation import evaluate_model, stream_test_clips
from fedst.model.network import NetworkConfig, build_network

H, W = 32, 40
DIM = 16
TINY = NetworkConfig(indicator_dim=DIM, decoder_dim=32, drop_path_rate=0.0)
INDICATOR = torch.nn.functional.normalize(torch.arange(DIM, dtype=torch.float32), dim=0)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_net(**overrides):
    torch.manual_seed(0)
    return build_network(dataclasses.replace(TINY, **overrides)).eval()


# -- evaluation through the streaming path ---------------------------------------------------------


@pytest.fixture
def test_video(write_site):
    """Site D, one 14-frame test video at 12 fps labelled every 2nd frame: clip frames 0.2 s apart
    are 2.4 frames apart, so the context offsets (3, 5, 8 frames back) are not a fixed stride and
    include unlabelled frames."""
    write_site("D", videos={"v1": 14}, size=(H, W), fps=12, label_every=2)
    source = GenericLayoutSource(write_site.args[0], "D")
    return ClipDataset(source, "test", ClipConfig(image_size=(H, W)))


def test_streaming_evaluation_gives_the_clip_forward_predictions_on_a_test_video(test_video):
    net = tiny_net()
    # clip_frame_positions at 12 fps, 0.2 s (hand check: frame 10 -> 2, 5, 7, 10)
    assert clip_frame_positions(test_video.videos[0].times, 10, 4, 0.2) == [2, 5, 7, 10]
    streamed = list(stream_test_clips(net, test_video, INDICATOR, torch.device("cpu")))
    assert [sid for _, _, sid, _ in streamed] == [test_video[i][2] for i in range(len(test_video))]
    for index, (frame, mask, sample_id, logits) in enumerate(streamed):
        clip, expected_mask, _ = test_video[index]
        with torch.no_grad():
            expected = net(clip[None], INDICATOR)[0]  # [K, H, W], all 4 frames encoded
        assert torch.equal(mask, expected_mask), sample_id
        assert torch.equal(frame, clip[-1]), sample_id
        assert torch.allclose(logits, expected, atol=1e-5), sample_id
        assert torch.equal(logits.argmax(0), expected.argmax(0)), sample_id


def test_streaming_evaluation_encodes_each_needed_frame_once(test_video):
    net = tiny_net()
    calls = []
    net.encoder.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    evaluate_model(net, test_video, INDICATOR, torch.device("cpu"))
    # labelled 0, 2, ..., 12 (7 clips, 28 frames for the clip forward); by hand, their clips use
    # 12 -> 4, 7, 9; 10 -> 2, 5, 7; 8 -> 0, 3, 5; 6 -> 1, 3; 4 -> 1: frames 0..10 and 12, not 11
    assert calls == [1] * 12
