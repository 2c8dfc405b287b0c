"""Specification of the decode-head placement of the temporal module (CFFM's;
``network.temporal_placement=decode_head``, fedst/model/temporal_head.py): shapes, the composition
decoder map -> 1/8 -> block -> [before, after] -> classifier, parameter groups and partition,
streaming, and the ONNX export's feature cache."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fedst.experiment import TrainConfig
from fedst.export import OnnxStreamer, export_onnx
from fedst.methods.optimizer import param_groups
from fedst.model.network import FedSTNet, NetworkConfig
from fedst.model.partition import PRESETS, split_state
from tests.test_network import INDICATOR, TINY, make_net

H, W = 60, 84  # stride-4 map 15 x 21 -> the block's map 7 x 10 (CFFM's int(h / 2))
HEAD = {"temporal_placement": "decode_head"}  # on test_network's tiny network

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def net() -> FedSTNet:
    return make_net(**HEAD).eval()


def frames_of(batch: int, frames: int, seed: int = 0) -> torch.Tensor:
    """Random frames [batch, frames, 3, H, W] at this file's odd-sized maps."""
    return torch.randn(batch, frames, 3, H, W, generator=torch.Generator().manual_seed(seed))


def test_forward_gives_current_frame_logits_features_and_every_frame_s_logits(net):
    with torch.no_grad():
        logits, feats, frame_logits = net(
            frames_of(2, 4), INDICATOR, return_features=True, return_frame_logits=True
        )
        single_logits, single = net(
            frames_of(2, 4), INDICATOR, use_temporal=False, return_frame_logits=True
        )
        current_only = net(frames_of(2, 4)[:, -1:], INDICATOR)  # T = 1: the decoder alone
    assert logits.shape == (2, 4, H, W)
    assert frame_logits.shape == (2, 4, 4, H, W)
    assert [tuple(f.shape[1:]) for f in feats] == [
        (32, 15, 21),
        (64, 8, 11),
        (160, 4, 6),
        (256, 2, 3),
    ]
    assert torch.allclose(single, frame_logits, atol=1e-6)  # the per-frame predictions need no TS
    assert torch.allclose(single_logits, current_only, atol=1e-5)
    assert torch.allclose(frame_logits[:, -1], current_only, atol=1e-5)
    encoder_placement = make_net(temporal_placement="encoder").eval()
    with (
        torch.no_grad()
    ):  # the same outputs in the encoder placement (tests/test_clip_frame_loss.py)
        _, encoder_frame_logits = encoder_placement(
            frames_of(2, 4), INDICATOR, return_frame_logits=True
        )
    assert encoder_frame_logits.shape == frame_logits.shape
    with pytest.raises(ValueError, match="temporal_variant"):
        NetworkConfig(temporal_placement="decode_head", temporal_variant="windowed")


def test_the_placement_equals_decoder_map_then_half_size_block_then_classifier_on_both(net):
    """An independent composition with per-sample indicators: each frame on its own through the
    encoder, CS and the decoder (its head's input caught by a hook, its output the frame's
    prediction); bilinear to (h // 2, w // 2); the block over the 4 maps; the 1x1 classifier on
    [before, after] of the current frame; bilinear to the stride-4 size, then to the input."""
    clip = frames_of(2, 4)
    indicators = torch.stack([INDICATOR, INDICATOR.flip(0)])  # [B, D]: one site per sample
    head = net.temporal["decode_head"]
    maps, frame_logits = [], []
    hook = net.decoder.head.register_forward_hook(lambda _m, inputs, _o: maps.append(inputs[0]))
    try:
        with torch.no_grad():
            for t in range(clip.shape[1]):
                feats = net.encoder(clip[:, t])
                feats[1] = net.channel_selection["1"](feats[1], indicators)
                frame_logits.append(net.decoder(feats, (H, W)))
    finally:
        hook.remove()
    with torch.no_grad():
        half = [F.interpolate(m, size=(7, 10), mode="bilinear", align_corners=False) for m in maps]
        after = head.block(half)
        weight, bias = head.classifier.weight, head.classifier.bias
        expected = F.conv2d(torch.cat([half[-1], after], dim=1), weight, bias)
        expected = F.interpolate(expected, size=(15, 21), mode="bilinear", align_corners=False)
        expected = F.interpolate(expected, size=(H, W), mode="bilinear", align_corners=False)
        logits, got_frames = net(clip, indicators, return_frame_logits=True)
    assert torch.allclose(logits, expected, atol=1e-5), (logits - expected).abs().max()
    assert torch.allclose(got_frames, torch.stack(frame_logits, dim=1), atol=1e-5)
    assert not torch.allclose(logits, got_frames[:, -1], atol=1e-3)  # the block changed it


def test_the_block_and_its_classifier_train_at_the_temporal_lr_and_travel_with_the_module(net):
    train = TrainConfig(lr=3e-4, temporal_lr_mult=10.0)
    groups = param_groups(net.named_parameters(), train)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    names = dict(net.named_parameters())
    temporal = [n for n in names if n.startswith("temporal.decode_head.")]
    assert {"temporal.decode_head.classifier.weight", "temporal.decode_head.block.q.weight"} <= set(
        temporal
    )
    assert all(lr_of[id(names[n])] == pytest.approx(3e-3) for n in temporal)
    assert all(lr_of[id(p)] == pytest.approx(3e-4) for n, p in names.items() if n not in temporal)
    shared = split_state(net, PRESETS["encoder_query"]).shared  # FedST's: shared, as the decoder
    assert set(temporal) <= set(shared) and "decoder.head.weight" in shared
    private = split_state(net, PRESETS["rsc"]).personal  # the Table IX reading: private as a whole
    assert set(temporal) <= set(private) and "decoder.head.weight" not in private


def test_streaming_a_video_frame_by_frame_or_batched_gives_the_same_logits(net):
    """Streaming parity with the clip forward: tests/test_network.py (both placements); here the
    batched ``step_frames`` (one decoder pass over the frames' maps) against ``step``, on a video
    longer than the history span, every other frame a context frame."""
    video = frames_of(9, 1, seed=3)[:, 0]  # [9, 3, H, W]
    predict = [t % 2 == 0 for t in range(len(video))]
    one_by_one = net.stream(INDICATOR, frame_stride=2)
    expected = [one_by_one.step(f[None], predict=p) for f, p in zip(video, predict, strict=True)]
    batched = net.stream(INDICATOR, frame_stride=2).step_frames(video, predict=predict)
    assert torch.allclose(batched, torch.cat([e for e in expected if e is not None]), atol=1e-5)


@pytest.mark.parametrize("placement", ["decode_head", "encoder"])
def test_the_onnx_export_streams_what_pytorch_streams_in_either_placement(placement, tmp_path):
    """The exported step caches what ``FedSTNet.stream`` caches (the decode head's fused maps
    [1, D, H/4, W/4], or the temporal stage's encoder maps), and ONNX Runtime streams a video
    longer than the history span as PyTorch does, to tests/test_infer.py's tolerance (1e-4)."""
    pytest.importorskip("onnxruntime")
    model = make_net(temporal_placement=placement).eval()
    path = export_onnx(model, INDICATOR, (H, W), interval_s=1.0, out_path=tmp_path / "step.onnx")
    cache = json.loads(path.with_suffix(".json").read_text())["inputs"]
    if placement == "decode_head":
        assert cache["context_decode_head"] == [3, 1, TINY.decoder_dim, H // 4, W // 4]
    else:
        stage_1 = [math.ceil(math.ceil(size / 4) / 2) for size in (H, W)]  # stride 4, then 2
        assert cache["context_s1"] == [3, 1, 64, *stage_1]
    onnx_stream = OnnxStreamer(path, threads=1)
    torch_stream = model.stream(INDICATOR, interval_s=1.0)
    for t, frame in enumerate(frames_of(6, 1, seed=5)[:, 0]):  # 6 frames: the cache is reused
        expected = torch_stream.step(frame[None], float(t))
        got = torch.from_numpy(onnx_stream.step(frame[None].numpy(), float(t)))
        assert (got - expected).abs().max() <= 1e-4, f"frame {t}"
