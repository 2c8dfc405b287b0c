"""Specification of the FedST network: channel selection (Eq. 7-8), FedSTNet, streaming."""

import dataclasses
import math

import pytest
import torch

from fedst.data.clips import clip_frame_positions
from fedst.model.channel_selection import ChannelSelection, PromptBias
from fedst.model.losses import SegmentationLoss
from fedst.model.network import FedSTNet, NetworkConfig, build_network

H, W = 32, 40
DIM = 16  # a small indicator keeps the tests fast
TINY = NetworkConfig(indicator_dim=DIM, decoder_dim=32, drop_path_rate=0.0)


def make_net(**overrides) -> FedSTNet:
    torch.manual_seed(0)
    return build_network(dataclasses.replace(TINY, **overrides))


@pytest.fixture(scope="module")
def net() -> FedSTNet:
    return make_net().eval()


def clip_of(batch: int = 2, frames: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, frames, 3, H, W, generator=torch.Generator().manual_seed(seed))


INDICATOR = torch.nn.functional.normalize(torch.arange(DIM, dtype=torch.float32), dim=0)


pytestmark = pytest.mark.usefixtures("single_torch_thread")


# --- channel selection (Eq. 7-8) -----------------------------------------------------------


def test_gate_is_the_sigmoid_of_the_fc_of_pooled_features_and_indicator_and_scales_the_features():
    """Eq. 7-8 by hand: 2 channels, a 3-d indicator, set FC weights; GAP is the spatial mean."""
    cs = ChannelSelection(channels=2, indicator_dim=3)
    with torch.no_grad():
        cs.fc.weight.copy_(torch.tensor([[0.5, 0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.25]]))
        cs.fc.bias.copy_(torch.tensor([-0.5, 0.0]))
    checkerboard = torch.tensor([[1.0, -1.0], [-1.0, 1.0]]).repeat(2, 3)  # [4, 6], mean 0
    feat = torch.stack([1.0 + checkerboard, -2.0 + 3 * checkerboard])[None]  # [1, 2, 4, 6]
    indicator = torch.tensor([1.0, 0.0, 2.0])
    # channel 0: 0.5 * GAP_0 (1) + 1 * xi_0 (1) - 0.5 = 1; channel 1: GAP_1 (-2) + 0.25 * xi_2 (2)
    sigmoid = [1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(1.5))]
    torch.testing.assert_close(cs.gate(feat, indicator), torch.tensor([sigmoid]))
    expected = torch.stack([feat[0, c] * (1 + sigmoid[c]) for c in range(2)])[None]
    torch.testing.assert_close(cs(feat, indicator), expected)


def test_channel_selection_depends_on_the_indicator():
    torch.manual_seed(0)
    cs = ChannelSelection(channels=8, indicator_dim=DIM)
    feat = torch.randn(2, 8, 5, 6)
    assert not torch.allclose(cs(feat, INDICATOR), cs(feat, INDICATOR.flip(0)))


def test_prompt_bias_starts_as_identity_then_adds_a_per_channel_bias_of_the_indicator():
    torch.manual_seed(0)
    prompt = PromptBias(channels=8, indicator_dim=DIM)
    feat = torch.randn(2, 8, 5, 6)
    assert torch.equal(prompt(feat, INDICATOR), feat)
    torch.nn.init.normal_(prompt.proj.weight)
    bias = prompt.proj(INDICATOR)
    assert torch.allclose(prompt(feat, INDICATOR), feat + bias[None, :, None, None], atol=1e-6)


def test_per_sample_indicators_must_match_the_batch():
    cs = ChannelSelection(channels=8, indicator_dim=DIM)
    with pytest.raises(ValueError, match="site indicator must be"):
        cs(torch.randn(2, 8, 3, 3), torch.randn(3, DIM))


# --- FedSTNet --------------------------------------------------------------------------------


def test_forward_gives_current_frame_logits_and_encoder_features(net):
    clip = clip_of()
    with torch.no_grad():
        logits, feats = net(clip, INDICATOR, return_features=True)
        current_only = net.encoder(clip[:, -1])
    assert logits.shape == (2, 4, H, W)
    assert [f.shape[1] for f in feats] == [32, 64, 160, 256]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(feats, current_only, strict=True))


def test_earlier_frames_change_the_output_only_when_temporal_is_on(net):
    clip = clip_of()
    other_past = clip.clone()
    other_past[:, :-1] = clip_of(seed=1)[:, :-1]
    with torch.no_grad():
        assert not torch.allclose(net(clip, INDICATOR), net(other_past, INDICATOR))
        off = net(clip, INDICATOR, use_temporal=False)
        assert torch.equal(off, net(other_past, INDICATOR, use_temporal=False))
        assert torch.allclose(off, net(clip[:, -1:], INDICATOR), atol=1e-6)
    no_ts = make_net(temporal=False).eval()
    with torch.no_grad():
        assert torch.equal(no_ts(clip, INDICATOR), no_ts(other_past, INDICATOR))


def test_channel_selection_makes_the_output_depend_on_the_site_indicator(net):
    clip = clip_of()
    with torch.no_grad():
        assert not torch.allclose(net(clip, INDICATOR), net(clip, INDICATOR.flip(0)))
        per_sample = torch.stack([INDICATOR, INDICATOR])
        assert torch.allclose(net(clip, INDICATOR), net(clip, per_sample), atol=1e-6)


# Table IV rows: (TS, Prompt, CS).
@pytest.mark.parametrize(
    ("temporal", "prompt", "channel_selection"),
    [(False, False, False), (True, False, False), (True, True, False), (True, True, True)],
)
def test_each_table_iv_switch_combination_builds_runs_and_backpropagates(
    temporal, prompt, channel_selection
):
    model = make_net(temporal=temporal, prompt=prompt, channel_selection=channel_selection)
    assert bool(model.temporal) == temporal
    assert bool(model.channel_selection) == channel_selection
    assert bool(model.prompt) == (prompt and not channel_selection)
    indicator = INDICATOR if prompt else None
    if temporal:  # the default objective also reads every clip frame's own prediction
        logits, frame_logits = model(clip_of(batch=1), indicator, return_frame_logits=True)
        assert frame_logits.shape == (1, 4, 4, H, W)  # [B, T, K, H, W]
        (logits.sum() + frame_logits.sum()).backward()
    else:
        logits = model(clip_of(batch=1), indicator)
        logits.sum().backward()
    assert logits.shape == (1, 4, H, W)
    assert model.decoder.head.weight.grad is not None
    assert all(p.grad is not None for p in model.temporal.parameters())


def test_missing_indicator_wrong_clip_length_and_cs_without_prompt_are_errors(net):
    with pytest.raises(ValueError, match="site indicator"):
        net(clip_of())
    with pytest.raises(ValueError, match="T=3 frames"):
        net(clip_of(frames=3), INDICATOR)
    with pytest.raises(ValueError, match="needs prompt=True"):
        NetworkConfig(prompt=False, channel_selection=True)
    with pytest.raises(ValueError, match="stage indices"):
        NetworkConfig(temporal_stages=(4,))


def test_detached_earlier_frames_give_the_same_output_and_still_train():
    model = make_net(detach_previous_frames=True).eval()
    reference = make_net().eval()
    clip = clip_of()
    out = model(clip, INDICATOR)
    assert torch.allclose(out, reference(clip, INDICATOR), atol=1e-5)
    out.sum().backward()
    assert model.encoder.patch_embed.proj.weight.grad is not None


def test_encoder_gradient_checkpointing_recomputes_to_the_same_loss_and_gradients():
    # with stochastic depth on: the recomputation must replay the same dropped paths
    models = {
        on: make_net(encoder_grad_checkpointing=on, drop_path_rate=0.3) for on in (False, True)
    }
    assert all(s.grad_checkpointing for s in models[True].encoder.stages)
    assert not any(s.grad_checkpointing for s in models[False].encoder.stages)
    assert not any(
        s.grad_checkpointing
        for s in make_net(encoder_grad_checkpointing=True).eval().encoder.stages
    )
    masks = torch.randint(0, 4, (2, H, W), generator=torch.Generator().manual_seed(1))
    grads = {}
    for on, model in models.items():
        torch.manual_seed(7)
        loss = SegmentationLoss()(model(clip_of(), INDICATOR), masks)
        loss.backward()
        grads[on] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys()
    assert any(k.startswith("encoder.stages.0") for k in grads[True])
    for name, grad in grads[False].items():
        assert torch.allclose(grads[True][name], grad, atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_encoder_features_equal_the_forward_pass_s_map_without_running_what_follows(net, stage):
    clip = clip_of()
    _, feats = net(clip, INDICATOR, use_temporal=False, return_features=True)
    assert torch.equal(net.encoder_features(clip, stage), feats[stage])
    ran = []
    hooks = [s.register_forward_hook(lambda *_: ran.append(1)) for s in net.encoder.stages]
    hooks.append(net.decoder.register_forward_hook(lambda *_: ran.append("decoder")))
    try:
        net.encoder_features(clip, stage)
    finally:
        for hook in hooks:
            hook.remove()
    assert ran == [1] * (stage + 1)  # stages 0..stage, no later stage, no decoder


@pytest.mark.parametrize("placement", ["encoder", "decode_head"])
def test_streaming_equals_clip_forward_on_every_frame_of_a_video(net, placement):
    """Encoder placement: the temporal stages' maps cached; decode-head placement (CFFM's): the
    fused decoder maps (tests/test_temporal_head.py)."""
    if placement != net.cfg.temporal_placement:
        net = make_net(temporal_placement=placement).eval()
    video = torch.randn(
        9, 1, 3, H, W, generator=torch.Generator().manual_seed(3)
    )  # > history span 7
    stride = 2
    stream = net.stream(INDICATOR, frame_stride=stride)
    times = [float(t) for t in range(len(video))]
    for t, frame in enumerate(video):
        streamed = stream.step(frame)
        positions = clip_frame_positions(times, t, num_frames=4, interval_s=float(stride))
        clip = video[positions].transpose(0, 1)  # [4, 1, 3, H, W] -> [1, 4, 3, H, W]
        with torch.no_grad():
            expected = net(clip, INDICATOR)
        assert torch.allclose(streamed, expected, atol=1e-5), f"frame {t}"


def test_streaming_without_temporal_module_equals_single_frame_forward():
    model = make_net(temporal=False).eval()
    stream = model.stream(INDICATOR, frame_stride=1)
    frame = torch.randn(1, 3, H, W)
    with torch.no_grad():
        assert torch.allclose(stream.step(frame), model(frame[:, None], INDICATOR), atol=1e-6)


@pytest.mark.parametrize("placement", ["encoder", "decode_head"])
def test_a_few_training_steps_on_a_fixed_batch_lower_the_loss(placement):
    model = make_net(temporal_placement=placement).train()
    generator = torch.Generator().manual_seed(0)
    cells = torch.randint(0, 4, (2, H // 8, W // 8), generator=generator)
    target = cells.repeat_interleave(8, 1).repeat_interleave(8, 2)  # [2, H, W] blocks of 8x8
    colour = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    frame = colour[target].permute(0, 3, 1, 2)  # [2, H, W, 3] -> [2, 3, H, W]
    clip = frame[:, None].repeat(1, 4, 1, 1, 1) + 0.1 * clip_of()  # the class shows in the image
    loss_fn = SegmentationLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = loss_fn(model(clip, INDICATOR), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
