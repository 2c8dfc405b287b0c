"""Specification of the segmentation loss L_seg = CE + lambda1 * Dice (paper Eq. 9)."""

import math

import pytest
import torch

from fedst.model.losses import SegmentationLoss, soft_dice_loss


def one_hot_logits(target: torch.Tensor, num_classes: int, scale: float) -> torch.Tensor:
    return scale * torch.nn.functional.one_hot(target, num_classes).permute(0, 3, 1, 2).float()


def test_hand_computed_value_for_uniform_logits_on_one_pixel():
    # 2 classes, logits 0 -> p = (0.5, 0.5); target class 0.
    # CE = ln 2; Dice_0 = (2*0.5 + 1) / (0.5 + 1 + 1) = 0.8; Dice_1 = (0 + 1) / (0.5 + 0 + 1) = 2/3.
    logits = torch.zeros(1, 2, 1, 1)
    target = torch.zeros(1, 1, 1, dtype=torch.long)
    expected_dice = 1 - (0.8 + 2 / 3) / 2
    assert soft_dice_loss(logits, target).item() == pytest.approx(expected_dice, abs=1e-6)
    loss = SegmentationLoss(lambda_dice=0.3, num_classes=2)(logits, target)
    assert loss.item() == pytest.approx(math.log(2) + 0.3 * expected_dice, abs=1e-6)


def test_perfect_prediction_gives_near_zero_loss_and_beats_a_wrong_one():
    torch.manual_seed(0)
    target = torch.randint(0, 4, (2, 8, 8))
    loss_fn = SegmentationLoss()
    perfect = loss_fn(one_hot_logits(target, 4, 30.0), target)
    wrong = loss_fn(one_hot_logits((target + 1) % 4, 4, 30.0), target)
    assert perfect.item() < 1e-3
    assert wrong.item() > 10.0


def test_ignored_pixels_do_not_contribute():
    torch.manual_seed(0)
    target = torch.randint(0, 4, (2, 8, 8))
    target[:, :3] = 255
    logits = torch.randn(2, 4, 8, 8)
    changed = logits.clone()
    changed[:, :, :3] = torch.randn(2, 4, 3, 8) * 10
    loss_fn = SegmentationLoss()
    assert loss_fn(logits, target).item() == pytest.approx(
        loss_fn(changed, target).item(), abs=1e-6
    )
    cropped = loss_fn(logits[:, :, 3:], target[:, 3:])
    assert loss_fn(logits, target).item() == pytest.approx(cropped.item(), abs=1e-6)


def test_all_ignored_batch_gives_zero_loss_with_gradient_path():
    logits = torch.randn(1, 4, 4, 4, requires_grad=True)
    loss = SegmentationLoss()(logits, torch.full((1, 4, 4), 255))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(logits.grad).all()


def test_labels_outside_the_classes_are_rejected():
    with pytest.raises(ValueError, match="labels must be in"):
        SegmentationLoss()(torch.zeros(1, 4, 2, 2), torch.full((1, 2, 2), 7))


@pytest.mark.parametrize(
    ("num_classes", "target", "expected"),
    [
        # uniform logits: p_c = 1/3 on 3 valid pixels, one of each class. CE = ln 3; every
        # Dice_c = (2 * 1/3 + 1) / (3 * 1/3 + 1 + 1) = 5/9, so Dice loss = 4/9
        (3, [[0, 1], [2, 255]], math.log(3) + 0.3 * 4 / 9),
        # p_c = 1/6 on 3 valid pixels of classes 0, 3, 5. CE = ln 6; present classes
        # (2/6 + 1) / (3/6 + 1 + 1) = 8/15, absent ones (0 + 1) / (3/6 + 1) = 2/3:
        # Dice loss = 1 - (3 * 8/15 + 3 * 2/3) / 6 = 0.4
        (6, [[0, 5], [3, 255]], math.log(6) + 0.3 * 0.4),
    ],
    ids=["3-classes", "6-classes"],
)
def test_the_network_class_count_is_the_loss_class_count(num_classes, target, expected):
    logits = torch.zeros(1, num_classes, 2, 2, requires_grad=True)
    loss = SegmentationLoss(lambda_dice=0.3, num_classes=num_classes)(
        logits, torch.tensor([target])
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    with pytest.raises(ValueError, match="expected num_classes=4"):
        SegmentationLoss()(logits, torch.tensor([target]))  # the default is the unified 4


def test_a_label_of_a_class_the_network_lacks_is_rejected_with_its_value():
    with pytest.raises(
        ValueError, match=r"labels must be in \[0, 3\) or 255; got value\(s\) \[3\]"
    ):
        SegmentationLoss(num_classes=3)(torch.zeros(1, 3, 1, 2), torch.tensor([[[2, 3]]]))
