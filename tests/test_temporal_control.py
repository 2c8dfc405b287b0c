"""The temporal module's positive control (issue 47, studies/temporal_control/temporal_control.py), seed 0.

The current frame of every clip is blanked (its label kept, t-1..t-3 intact), so only the clip's
own past says where the instruments are. At one seed and TEST_STEPS training steps per network
(the protocol's 600), with the default network (CFFM's block in the decode head, every clip frame
supervised at 0.5: issue 58), the three arms are trained and scored once (module fixture), then
checked twice:

* the rule stated before any run ("A positive control for the temporal module"): (a) own history
  >= 40 Dice and >= 25 above (b) the single-frame network and (c) the same network given another
  video's history. Measured at seed 0 (issue 58): (a) 46.21, (b) 2.14, (c) 6.18; over the
  protocol's 3 seeds 48.09 +- 2.61 (studies/temporal_cffm/README.md, sections 4 and 6). The
  encoder placement (``network.temporal_placement=encoder``) does not meet it (18.29);
* REGRESSION_GUARD (an addendum, stated after the protocol's run and before its own,
  studies/temporal_control/README.md): (a) at least 4 Dice points above both (b) and (c), a
  tripwire that names a cut-off temporal path even where the rule's margins would also fail.

About 8.3 minutes on one core (500 s at seed 0: 323 s own history, 110 s single frame, 15 s of
data generation, the rest scoring; 2-core Intel Xeon, 2026-12-06): marked slow (``make test-slow``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedst.data.procedural import generate
from fedst.training import BENCHMARK_SEED
from studies.temporal_control.temporal_control import (
    ARMS,
    SITES,
    THRESHOLD,
    Threshold,
    blank_current_frame,
    cffm_token_label,
    run_seed,
)

TEST_STEPS = 600
REGRESSION_GUARD = Threshold(own_history_min=0.0, margin=4.0)
"""An addendum stated after the protocol's run and before its own (studies/temporal_control/README.md): (a) at least
4 points above (b) and (c). Not the positive control's claim; a tripwire for a cut-off TS."""


def test_a_blanked_clip_keeps_its_history_and_nothing_of_the_current_frame():
    clips = torch.randn(2, 4, 3, 8, 10)  # [B, T, 3, H, W]
    blanked = blank_current_frame(clips)
    assert torch.equal(blanked[:, :-1], clips[:, :-1])
    current = blanked[:, -1]  # [B, 3, H, W]: one colour per clip, the earlier frames' mean
    assert torch.allclose(current, current[:, :, :1, :1].expand_as(current))
    assert torch.allclose(current[:, :, 0, 0], clips[:, :-1].mean(dim=(1, 3, 4)))
    other = clips.clone()
    other[:, -1] = torch.randn_like(other[:, -1])  # another current frame, same history
    assert torch.equal(blank_current_frame(other), blanked)


def test_the_rule_names_each_arm_that_breaks_it():
    passing = {"own_history": 60.0, "single_frame": 10.0, "other_history": 5.0}
    assert THRESHOLD.failures(passing) == []
    too_close = {**passing, "single_frame": 40.0}
    assert THRESHOLD.failures(too_close) == ["(a) 60.00 < single_frame 40.00 + 25.0"]
    assert len(THRESHOLD.failures({**passing, "own_history": 30.0})) == 2  # < 40, < (c) + 25


@pytest.fixture(scope="module")
def control_dice(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """arm -> Dice (%) of the three arms at seed 0 and TEST_STEPS steps (trained once)."""
    data_root = tmp_path_factory.mktemp("temporal_control") / "demo_v2"
    generate(data_root, BENCHMARK_SEED, "demo", sites=SITES, progress=False)
    results = run_seed(data_root, seed=0, steps=TEST_STEPS, arms=ARMS)
    return {arm: result["dice"] for arm, result in results.items()}


@pytest.mark.slow
def test_the_temporal_module_reads_the_clips_own_past_guard(control_dice):
    assert REGRESSION_GUARD.failures(control_dice) == [], control_dice


@pytest.mark.slow
def test_the_temporal_module_reads_the_clips_own_past(control_dice):
    assert THRESHOLD.failures(control_dice) == [], control_dice


def test_cffm_token_oracle_votes_per_token_of_a_third_of_a_window_and_padding_votes_for_nothing():
    """The oracle at the CFFM module's t-1 tokens, derived by hand at 1 px per cell: a 21 x 21
    label is 3 windows of 7 per side, so 9 tokens of 21 / 9 = 2.33 px; a class-1 band over
    columns 0-6 covers tokens 0-2 exactly, and token 3 starts at column 7."""
    label = np.zeros((21, 21), np.uint8)
    label[:, :7] = 1
    tokens = cffm_token_label(label, tokens_per_window=3, cell_pixels=1, window=7)
    np.testing.assert_array_equal(tokens, label)
    # One token per window: a 3 x 3 object in a 7 x 7 window loses to 40 background pixels ...
    label = np.zeros((7, 7), np.uint8)
    label[:3, :3] = 2
    assert (cffm_token_label(label, 1, cell_pixels=1, window=7) == 0).all()
    # ... but the padding that completes a 3 x 3 map to its 7 x 7 window votes for no class.
    small = np.full((3, 3), 2, np.uint8)
    assert (cffm_token_label(small, 1, cell_pixels=1, window=7) == 2).all()


def test_the_reader_at_the_modules_tokens_sees_each_earlier_frame_as_window_means():
    """With one token per window (l = 1) an earlier frame becomes its 7 x 7 windows' means,
    zero padding included (a 5 x 12 map: windows of 25 and 35 real cells out of 49); the
    current frame is left as it is."""
    from types import SimpleNamespace

    from studies.temporal_control.temporal_control import HistoryConcatReader

    reader = SimpleNamespace(net=SimpleNamespace(cfg=SimpleNamespace(window_size=7)))
    reader.tokens_per_window = (1, 1, 1)
    frames = torch.rand(2, 4, 3, 5, 12)
    out = HistoryConcatReader._at_module_tokens(reader, frames)
    left = frames[:, :3, :, :, :7].sum((-2, -1), keepdim=True) / 49
    right = frames[:, :3, :, :, 7:].sum((-2, -1), keepdim=True) / 49
    torch.testing.assert_close(out[:, :3, :, :, :7], left.expand(-1, -1, -1, 5, 7))
    torch.testing.assert_close(out[:, :3, :, :, 7:], right.expand(-1, -1, -1, 5, 5))
    torch.testing.assert_close(out[:, 3], frames[:, 3])
