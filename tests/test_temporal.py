"""Contract tests of the FedST temporal cross-attention (paper Eq. 3-4, fedst/model/temporal.py).

The central check compares the vectorised module with a slow per-window reference written
independently here: it pools each p x p cell one by one, picks each window's context tokens by
searching for the block whose centre is nearest to the window centre, and simply leaves out slots
outside the map. Agreement therefore also shows that padded and out-of-map slots get zero weight.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedst.model.temporal import TemporalCrossAttention, context_token_start

DIM, HEADS = 8, 2


def make_frames(
    height: int, width: int, num_frames: int = 4, batch: int = 2, seed: int = 0
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, DIM, height, width, generator=generator) for _ in range(num_frames)]


def make_module(**kwargs) -> TemporalCrossAttention:
    torch.manual_seed(0)
    return TemporalCrossAttention(DIM, HEADS, **kwargs).eval()


def nearest_block_start(window: int, s: int, p: int, n: int) -> int:
    """Start of the n consecutive p-cells whose centre is nearest the window centre (ties: low)."""
    window_centre = window * s + s / 2
    candidates = range(-4 * n - 4, window + 4 * n + 4)
    return min(candidates, key=lambda start: (abs((start + n / 2) * p - window_centre), start))


def reference_forward(module: TemporalCrossAttention, frames: list[torch.Tensor]) -> torch.Tensor:
    """Eq. 3-4 computed window by window, with only the context slots that exist in the map."""
    current = frames[-1]
    batch, channels, h, w = current.shape
    s, heads = module.window_size, module.num_heads
    head_dim = channels // heads
    pooled_maps = []
    for frame, p, fc in zip(frames, module.pool_sizes, module.pool, strict=True):
        rows, cols = math.ceil(h / p), math.ceil(w / p)
        padded = F.pad(frame, (0, cols * p - w, 0, rows * p - h))
        pooled = torch.empty(batch, rows, cols, channels)
        for a in range(rows):
            for b in range(cols):
                cell = padded[:, :, a * p : (a + 1) * p, b * p : (b + 1) * p]
                pooled[:, a, b] = fc(cell.permute(0, 2, 3, 1).reshape(batch, -1))
        pooled_maps.append(pooled)

    padded_current = F.pad(current, (0, -w % s, 0, -h % s))
    output = torch.zeros_like(padded_current)
    for i in range(math.ceil(h / s)):
        for j in range(math.ceil(w / s)):
            context, slots = [], []
            slot = 0
            for pooled, p, r in zip(
                pooled_maps, module.pool_sizes, module.receptive_fields, strict=True
            ):
                n = math.ceil(r / p)
                row0, col0 = nearest_block_start(i, s, p, n), nearest_block_start(j, s, p, n)
                for a in range(row0, row0 + n):
                    for b in range(col0, col0 + n):
                        if 0 <= a < pooled.shape[1] and 0 <= b < pooled.shape[2]:
                            context.append(pooled[:, a, b])
                            slots.append(slot)
                        slot += 1
            context_tokens = torch.stack(context, dim=1)  # [B, T_valid, C]
            window = padded_current[:, :, i * s : (i + 1) * s, j * s : (j + 1) * s]
            queries = window.flatten(2).transpose(1, 2)  # [B, s*s, C]
            q = module.q(queries).view(batch, s * s, heads, head_dim).transpose(1, 2)
            k = module.k(context_tokens).view(batch, -1, heads, head_dim).transpose(1, 2)
            v = module.v(context_tokens).view(batch, -1, heads, head_dim).transpose(1, 2)
            logits = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
            logits = logits + module.relative_position_bias[:, :, slots]
            attended = (logits.softmax(-1) @ v).transpose(1, 2).reshape(batch, s * s, channels)
            attended = module.proj(attended).transpose(1, 2).reshape(batch, channels, s, s)
            output[:, :, i * s : (i + 1) * s, j * s : (j + 1) * s] = attended
    return current + output[:, :, :h, :w]


@pytest.mark.parametrize(("height", "width"), [(7, 7), (14, 21), (10, 13), (3, 5)])
def test_output_shape_equals_input_shape(height: int, width: int) -> None:
    module = make_module()
    frames = make_frames(height, width)
    assert module(frames).shape == frames[-1].shape


def test_paper_defaults_give_132_context_tokens_per_window() -> None:
    module = make_module()
    assert module.num_frames == 4
    assert module.tokens_per_side == (7, 5, 3, 7)
    assert module.context_tokens_per_window == 49 + 25 + 9 + 49 == 132


@pytest.mark.parametrize(
    ("window", "s", "p", "n", "expected"),
    [
        (0, 7, 7, 7, -3),  # t-3: 49x49 area centred on window 0 -> cells -3..3
        (2, 7, 7, 7, -1),
        (0, 7, 4, 5, -2),  # t-2: pixels [-8, 12), centre 2 vs window centre 3.5
        (1, 7, 4, 5, 0),  # pixels [0, 20), centre 10 vs window centre 10.5
        (0, 7, 2, 3, 0),  # t-1: pixels [0, 6)
        (1, 7, 2, 3, 4),  # pixels [8, 14), centre 11 vs 10.5
        (3, 7, 1, 7, 21),  # current frame: exactly the window's own pixels
        (0, 2, 1, 2, 0),  # even n, centred exactly
    ],
)
def test_context_token_start_centres_the_block_on_the_window(
    window: int, s: int, p: int, n: int, expected: int
) -> None:
    assert context_token_start(window, s, p, n) == expected
    assert nearest_block_start(window, s, p, n) == expected


@pytest.mark.parametrize(("height", "width"), [(10, 13), (3, 5), (14, 14)])
def test_matches_per_window_reference_that_omits_padded_and_out_of_map_slots(
    height: int, width: int
) -> None:
    module = make_module()
    frames = make_frames(height, width)
    with torch.no_grad():
        torch.testing.assert_close(module(frames), reference_forward(module, frames))


def test_single_frame_configuration_is_windowed_self_attention() -> None:
    module = make_module(receptive_fields=(7,), pool_sizes=(1,))
    frames = make_frames(14, 10, num_frames=1)
    assert module.context_tokens_per_window == 49
    with torch.no_grad():
        torch.testing.assert_close(module(frames), reference_forward(module, frames))


def test_residual_is_exactly_current_frame_when_proj_is_zero() -> None:
    module = make_module()
    with torch.no_grad():
        module.proj.weight.zero_()
        module.proj.bias.zero_()
    frames = make_frames(10, 13)
    assert torch.equal(module(frames), frames[-1])


def test_oldest_frame_changes_exactly_the_windows_whose_receptive_field_sees_it() -> None:
    module = make_module()
    frames = make_frames(42, 42, batch=1)
    perturbed = [frame.clone() for frame in frames]
    # Pixel (35, 35) lies in pooled cell (5, 5) of F_{t-3} (p = 7); window i sees cells i-3..i+3.
    perturbed[0][:, :, 35, 35] += 10.0
    with torch.no_grad():
        changed = (module(perturbed) - module(frames)).abs().amax(dim=(0, 1)) > 1e-6
    window_changed = changed.view(6, 7, 6, 7).any(dim=3).any(dim=1)  # [windows_h, windows_w]
    sees_cell_5 = torch.arange(6) >= 2
    assert torch.equal(window_changed, sees_cell_5[:, None] & sees_cell_5[None, :])


def test_context_validity_masks_borders_and_current_frame_padding() -> None:
    module = make_module()
    _, valid = module.context_layout(10, 13, torch.device("cpu"))
    assert valid.shape == (4, 132)  # 2 x 2 windows
    oldest, current = slice(0, 49), slice(132 - 49, 132)
    # 10 x 13 pools (p = 7) to 2 x 2 cells; window (0, 0) sees cells -3..3 -> only 2 x 2 exist.
    assert int(valid[0, oldest].sum()) == 4
    # Window (1, 1) of the current frame covers rows 7..13, cols 7..13: 3 x 6 real pixels.
    assert int(valid[3, current].sum()) == 18
    assert bool(valid[0, current].all())


def test_relative_position_bias_has_documented_shape_and_changes_output() -> None:
    module = make_module()
    assert module.relative_position_bias.shape == (HEADS, 49, 132)
    frames = make_frames(10, 13)
    with torch.no_grad():
        module.relative_position_bias.zero_()
        without_bias = module(frames)
        module.relative_position_bias.normal_(std=1.0)
        with_bias = module(frames)
    assert not torch.allclose(without_bias, with_bias)


def test_gradients_reach_q_k_v_pooling_and_bias() -> None:
    module = make_module().train()
    frames = make_frames(10, 13)
    module(frames).square().sum().backward()
    named = dict(module.named_parameters())
    expected = ["q.weight", "k.weight", "v.weight", "proj.weight", "relative_position_bias"]
    expected += [f"pool.{index}.weight" for index in range(3)]
    for name in expected:
        grad = named[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_no_nan_when_windows_are_almost_entirely_padding() -> None:
    module = make_module().train()
    frames = [frame.requires_grad_() for frame in make_frames(1, 1)]  # 48 of 49 pixels padded
    output = module(frames)
    output.sum().backward()
    assert torch.isfinite(output).all()
    assert all(torch.isfinite(frame.grad).all() for frame in frames)


def test_batch_elements_are_processed_independently() -> None:
    module = make_module()
    frames = make_frames(10, 13, batch=3)
    with torch.no_grad():
        batched = module(frames)
        single = module([frame[1:2] for frame in frames])
    torch.testing.assert_close(batched[1:2], single)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"receptive_fields": (49, 20, 7), "pool_sizes": (7, 4, 2, 1)},  # lengths differ
        {"receptive_fields": (49, 7), "pool_sizes": (7, 2)},  # current frame pooled
        {"receptive_fields": (49, 9), "pool_sizes": (7, 1)},  # current r != window size
        {"receptive_fields": (0, 7), "pool_sizes": (7, 1)},
        {"attn_drop": 1.0},
    ],
)
def test_invalid_arguments_raise_with_the_offending_values(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="TemporalCrossAttention"):
        TemporalCrossAttention(DIM, HEADS, **kwargs)


def test_dim_not_divisible_by_heads_raises() -> None:
    with pytest.raises(ValueError, match="num_heads=3"):
        TemporalCrossAttention(8, 3)


def test_wrong_frame_count_or_shape_raises() -> None:
    module = make_module()
    with pytest.raises(ValueError, match="expects 4 frames"):
        module(make_frames(7, 7, num_frames=3))
    frames = make_frames(7, 7)
    frames[0] = frames[0][:, :, :6]
    with pytest.raises(ValueError, match="frame 0"):
        module(frames)
