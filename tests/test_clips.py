"""Specification of clip assembly, augmentation, loaders and the resumable batch stream."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch
from conftest import PART_COLOURS, draw_frame, frame_index_from_rgb

from fedst.data.clips import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    AugmentConfig,
    BatchStream,
    ClipConfig,
    ClipDataset,
    FrameLoaders,
    clip_frame_positions,
    make_loader,
)
from fedst.data.generic import GenericLayoutSource

NO_AUGMENT = AugmentConfig(enabled=False)


def to_rgb255(frames: torch.Tensor) -> np.ndarray:
    """Undo the ImageNet normalisation: [..., 3, H, W] -> [..., H, W, 3] in 0..255."""
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return ((frames * std + mean) * 255).movedim(-3, -1).numpy()


def clip_frame_indices(clip: torch.Tensor) -> list[int]:
    """Source frame index of each clip frame, read from its top-left background pixel."""
    return [frame_index_from_rgb(frame[0, 0]) for frame in to_rgb255(clip)]


@pytest.mark.parametrize(
    ("times", "current", "num_frames", "interval_s", "expected"),
    [
        ([0.0, 0.2, 0.4, 0.6, 0.8], 4, 4, 0.2, [1, 2, 3, 4]),  # fps 5, 0.2 s: consecutive
        ([0.0, 0.2, 0.4, 0.6, 0.8], 0, 4, 0.2, [0, 0, 0, 0]),  # video start: duplicate current
        ([0.0, 0.2, 0.4, 0.6, 0.8], 2, 4, 0.2, [2, 0, 1, 2]),  # t-3 before the first frame
        ([0.0, 0.5, 1.0, 1.5, 2.0], 4, 4, 0.2, [2, 3, 3, 4]),  # fps 2: nearest earlier frames
        ([0.0, 0.2, 0.6, 0.8], 3, 4, 0.2, [1, 1, 2, 3]),  # frame at 0.4 s missing: take 0.2 s
        ([0.0, 0.1, 0.2, 0.3, 0.4], 4, 3, 0.2, [0, 2, 4]),  # fps 10: every second frame
        ([0.0, 0.2, 0.4], 2, 1, 0.2, [2]),  # one frame: just the current one
    ],
)
def test_clip_frame_positions(times, current, num_frames, interval_s, expected):
    assert clip_frame_positions(times, current, num_frames, interval_s) == expected


def test_clip_frame_positions_tolerates_float_error_in_times():
    times = [i / 3 for i in range(7)]  # fps 3, interval 1/3 s
    assert clip_frame_positions(times, 6, 4, 1 / 3) == [3, 4, 5, 6]


def test_sparse_labels_give_samples_only_for_labelled_frames_but_clips_use_every_frame(write_site):
    site = write_site("D", videos={"v1": 10}, label_every=3)
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", ClipConfig(), NO_AUGMENT)
    assert dataset.num_samples == len(dataset) == 4  # frames 0, 3, 6, 9
    sample_ids = [dataset[i][2] for i in range(len(dataset))]
    assert sample_ids == ["D/v1/0", "D/v1/3", "D/v1/6", "D/v1/9"]
    assert clip_frame_indices(dataset[3][0]) == [6, 7, 8, 9]
    assert clip_frame_indices(dataset[1][0]) == [0, 1, 2, 3]


def test_clip_at_video_start_repeats_the_current_frame(write_site):
    site = write_site("D", videos={"v1": 5})
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", ClipConfig(), NO_AUGMENT)
    assert clip_frame_indices(dataset[0][0]) == [0, 0, 0, 0]
    assert clip_frame_indices(dataset[1][0]) == [1, 1, 0, 1]
    assert clip_frame_indices(dataset[4][0]) == [1, 2, 3, 4]


def test_fps_2_clip_takes_the_nearest_earlier_frames(write_site):
    site = write_site("D", videos={"v1": 4}, fps=2)
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", ClipConfig(), NO_AUGMENT)
    assert clip_frame_indices(dataset[3][0]) == [
        1,
        2,
        2,
        3,
    ]  # targets 0.9, 1.1, 1.3 s; frames at 0.5 s steps


def test_returned_tensors_have_the_documented_shapes_and_types(write_site):
    site = write_site("D", videos={"v1": 3})
    clip = ClipConfig(num_frames=3, image_size=(24, 36))
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip)
    frames, mask, sample_id = dataset[2]
    assert frames.shape == (3, 3, 24, 36) and frames.dtype == torch.float32
    assert mask.shape == (24, 36) and mask.dtype == torch.int64
    assert sample_id == "D/v1/2"
    assert (dataset.site_name, dataset.surgery_type, dataset.binary) == ("D", "hysterectomy", False)


def test_mask_matches_frame_content_after_resize(write_site):
    site = write_site("D", videos={"v1": 4}, size=(60, 80))
    clip = ClipConfig(num_frames=2, image_size=(90, 100))
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip, NO_AUGMENT)
    for index in range(len(dataset)):
        frames, mask, _ = dataset[index]
        current = to_rgb255(frames[-1])
        mask_np = mask.numpy()
        for part, colour in PART_COLOURS.items():
            interior = cv2.erode((mask_np == part).astype(np.uint8), np.ones((3, 3))) > 0
            assert interior.sum() > 30
            close = np.abs(current[interior] - np.array(colour)).max(axis=1) < 8
            assert close.mean() > 0.98, (index, part, close.mean())
        background = mask_np == 0
        assert (np.abs(current[background][:, 1] - 90) < 8).mean() > 0.9


def test_augmentation_off_is_exact_resize_and_normalisation(write_site):
    site = write_site("D", videos={"v1": 2}, size=(30, 50))
    clip = ClipConfig(num_frames=2, image_size=(20, 24))
    source = GenericLayoutSource(site.root, "D")
    dataset = ClipDataset(source, "train", clip, augment=None)
    frames, mask, _ = dataset[1]
    rgb, label = draw_frame(1, (30, 50))
    resized = cv2.resize(rgb, (24, 20), interpolation=cv2.INTER_LINEAR).astype(np.float32)
    expected = (resized / 255 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    np.testing.assert_allclose(frames[-1].permute(1, 2, 0).numpy(), expected, atol=1e-5)
    np.testing.assert_array_equal(
        mask.numpy(), cv2.resize(label, (24, 20), interpolation=cv2.INTER_NEAREST)
    )
    again = ClipDataset(source, "train", clip, NO_AUGMENT)[(1, 123)]
    assert torch.equal(again[0], frames) and torch.equal(again[1], mask)


def test_augmentation_is_identical_across_the_clip_and_fills_ignore(write_site):
    site = write_site("S", videos={"img1": 1}, size=(48, 64))
    augment = AugmentConfig(rotate_limit_deg=40, scale_limit=0.2)
    dataset = ClipDataset(GenericLayoutSource(site.root, "S"), "train", ClipConfig(), augment)
    unaugmented = ClipDataset(GenericLayoutSource(site.root, "S"), "train", ClipConfig())
    ignore_areas = []
    for aug_seed in range(4):
        frames, mask, _ = dataset[(0, aug_seed)]
        assert frames.shape[0] == 4
        for t in range(1, 4):
            assert torch.equal(frames[t], frames[0])
        assert not torch.equal(frames, unaugmented[0][0])
        rgb = to_rgb255(frames[-1])
        filled = rgb.max(axis=-1) < 10  # rotated-in area: black before normalisation
        ignored = mask.numpy() == 255
        ignore_areas.append(ignored.mean())
        assert (filled & ~ignored).mean() < 0.01 and (ignored & ~filled).mean() < 0.01
        shaft = mask.numpy() == 1
        assert (np.abs(rgb[shaft] - PART_COLOURS[1]).max(axis=1) < 30).mean() > 0.8
    assert max(ignore_areas) > 0.05


def test_augmentation_depends_only_on_the_given_seed(write_site):
    site = write_site("D", videos={"v1": 3})
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", augment=AugmentConfig())
    first, second, other = dataset[(2, 7)], dataset[(2, 7)], dataset[(2, 8)]
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[0], other[0])


def test_multi_frame_clip_gets_one_transform_for_every_frame(write_site):
    site = write_site("D", videos={"v1": 4})
    augment = AugmentConfig(rotate_limit_deg=40, scale_limit=0.2)
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", augment=augment)
    for aug_seed in range(3):
        frames, _, _ = dataset[(3, aug_seed)]
        rgb = to_rgb255(frames)  # [T, H, W, 3]
        background = (np.abs(rgb[..., 1] - 90) < 3) & (np.abs(rgb[..., 2] - 50) < 3)
        reds = [np.median(frame[mask_t, 0]) for frame, mask_t in zip(rgb, background, strict=True)]
        assert [frame_index_from_rgb([red]) for red in reds] == [0, 1, 2, 3]  # distinct frames
        filled = [to_rgb255(frame).max(axis=-1) < 10 for frame in frames]  # rotated-in area
        assert filled[-1].any()
        for t in range(3):
            np.testing.assert_array_equal(filled[t], filled[-1])


@pytest.mark.parametrize(("mode", "length"), [("repeat", 4), ("single", 1)])
def test_image_only_source_single_frame_mode(write_site, mode, length):
    site = write_site("S", videos={"img1": 1, "img2": 1})
    clip = ClipConfig(single_frame_mode=mode)
    dataset = ClipDataset(GenericLayoutSource(site.root, "S"), "train", clip, AugmentConfig())
    frames, mask, _ = dataset[(1, 3)]
    assert frames.shape == (length, 3, 128, 160) and mask.shape == (128, 160)
    assert all(torch.equal(frame, frames[0]) for frame in frames)


def test_single_mode_keeps_clips_for_real_videos(write_site):
    site = write_site("D", videos={"v1": 4, "img": 1})
    clip = ClipConfig(single_frame_mode="single")
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip)
    assert dataset.clip_length == 4 and dataset[4][0].shape[0] == 4


def test_make_loader_is_reproducible_and_independent_of_worker_count(write_site):
    site = write_site("D", videos={"v1": 5}, size=(16, 20))
    clip = ClipConfig(num_frames=2, image_size=(16, 20))
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip, AugmentConfig())
    runs = []
    for num_workers in (0, 0, 1):
        loader = make_loader(
            dataset, 2, shuffle=True, num_workers=num_workers, seed=3, drop_last=False
        )
        runs.append([batch for _ in range(2) for batch in loader])  # two epochs
    for other in runs[1:]:
        assert [b[2] for b in other] == [b[2] for b in runs[0]]
        assert all(torch.equal(a[0], b[0]) for a, b in zip(runs[0], other, strict=True))
    epoch_ids = [i for batch in runs[0][:3] for i in batch[2]]
    assert sorted(epoch_ids) == [f"D/v1/{i}" for i in range(5)]
    assert [b[2] for b in runs[0][:3]] != [b[2] for b in runs[0][3:]]  # reshuffled per epoch


def test_batch_stream_batches_are_full_and_cover_each_epoch(write_site):
    site = write_site("D", videos={"v1": 5}, size=(16, 20))
    clip = ClipConfig(num_frames=2, image_size=(16, 20))
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip)
    stream = BatchStream(dataset, batch_size=2, seed=0)
    ids = [i for _ in range(5) for i in stream.next_batch()[2]]
    assert len(ids) == 10
    assert sorted(ids[:5]) == sorted(ids[5:]) == [f"D/v1/{i}" for i in range(5)]
    assert stream.state_dict() == {"seed": 0, "epoch": 2, "position": 0}


def test_batch_stream_resumes_with_the_same_next_batches(write_site):
    site = write_site("D", videos={"v1": 3, "v2": 2}, size=(16, 20))
    clip = ClipConfig(num_frames=2, image_size=(16, 20))
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip, AugmentConfig())
    uninterrupted = BatchStream(dataset, batch_size=2, seed=11)
    expected = [uninterrupted.next_batch() for _ in range(6)]
    interrupted = BatchStream(dataset, batch_size=2, seed=11)
    for _ in range(2):
        interrupted.next_batch()
    state = interrupted.state_dict()
    resumed = BatchStream(dataset, batch_size=2, seed=11)
    resumed.load_state_dict(state)
    for want in expected[2:]:
        got = resumed.next_batch()
        assert got[2] == want[2]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    other_seed = BatchStream(dataset, batch_size=2, seed=12)
    assert [other_seed.next_batch()[2] for _ in range(3)] != [b[2] for b in expected[:3]]


def test_bad_clip_config_values_are_rejected():
    with pytest.raises(ValueError, match="single_frame_mode"):
        ClipConfig(single_frame_mode="loop")
    with pytest.raises(ValueError, match="num_frames"):
        ClipConfig(num_frames=0)
    with pytest.raises(ValueError, match="scale_limit"):
        AugmentConfig(scale_limit=1.5)


def test_batch_stream_fills_batches_larger_than_the_dataset(write_site):
    site = write_site("D", videos={"v1": 2}, size=(16, 20), label_every=2)
    clip = ClipConfig(num_frames=2, image_size=(16, 20))
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip)
    stream = BatchStream(dataset, batch_size=3, seed=0)
    frames, masks, ids = stream.next_batch()
    assert frames.shape == (3, 2, 3, 16, 20) and masks.shape == (3, 16, 20)
    assert ids == ["D/v1/0"] * 3
    assert stream.state_dict() == {"seed": 0, "epoch": 3, "position": 0}


def test_batch_stream_with_a_worker_gives_the_same_batches(write_site):
    site = write_site("D", videos={"v1": 3}, size=(16, 20))
    clip = ClipConfig(num_frames=2, image_size=(16, 20))
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip, AugmentConfig())
    in_process = BatchStream(dataset, batch_size=2, seed=5)
    with_worker = BatchStream(dataset, batch_size=2, seed=5, num_workers=1)
    for _ in range(3):
        want, got = in_process.next_batch(), with_worker.next_batch()
        assert got[2] == want[2] and torch.equal(got[0], want[0])
    with_worker.close()


def _float32_normalisation_before_uint8_loaders(frames: np.ndarray) -> np.ndarray:
    """What workers computed and sent before they sent uint8: uint8 [..., 3, H, W] -> float32."""
    mean = (np.array(IMAGENET_MEAN, dtype=np.float32) * 255).reshape(3, 1, 1)
    inv_std = (1 / (np.array(IMAGENET_STD, dtype=np.float32) * 255)).reshape(3, 1, 1)
    return (frames.astype(np.float32) - mean) * inv_std


def test_a_worker_sends_uint8_and_the_normalised_batches_equal_the_float_path(write_site):
    """Under a seed, with augmentation: the stream's batches (uint8 from one worker, normalised
    in this process) equal the float32 clips the workers used to send, stacked in the stream's
    order with the stream's augmentation seeds, to 1e-6; masks are equal."""
    site = write_site("D", videos={"v1": 4, "v2": 3}, size=(16, 20))
    clip = ClipConfig(num_frames=2, image_size=(16, 20))
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "train", clip, AugmentConfig())
    raw_clip, raw_mask, _ = dataset.load_raw((0, 123))
    assert raw_clip.dtype == torch.uint8 and raw_mask.dtype == torch.uint8
    stream = BatchStream(dataset, batch_size=3, seed=7, num_workers=1)
    order, aug_seeds = stream.epoch_plan(0)
    got = [stream.next_batch() for _ in range(2)]  # 6 of the epoch's 7 samples
    stream.close()
    for b, (clips, masks, ids) in enumerate(got):
        assert clips.dtype == torch.float32 and masks.dtype == torch.int64
        for j in range(3):
            item = (int(order[3 * b + j]), int(aug_seeds[3 * b + j]))
            frames, mask, sample_id = dataset.load_raw(item)
            expected = _float32_normalisation_before_uint8_loaders(frames.numpy())
            assert ids[j] == sample_id
            np.testing.assert_allclose(clips[j].numpy(), expected, rtol=0, atol=1e-6)
            assert torch.equal(masks[j], mask.long())


def test_a_batch_stream_given_the_class_count_rejects_other_labels_before_the_copy(write_site):
    site = write_site("D", videos={"v1": 3}, size=(16, 20))
    dataset = ClipDataset(
        GenericLayoutSource(site.root, "D"), "train", ClipConfig(num_frames=1, image_size=(16, 20))
    )
    assert BatchStream(dataset, batch_size=2, seed=0, num_classes=4).next_batch()
    with pytest.raises(
        ValueError, match=r"labels must be in \[0, 3\) or 255; got value\(s\) \[3\]"
    ):
        BatchStream(dataset, batch_size=2, seed=0, num_classes=3).next_batch()


def test_a_batch_streams_label_check_runs_in_its_workers_with_the_same_message(
    write_site, monkeypatch
):
    """With loader workers the training thread checks no labels (the collate function does,
    in the worker: forkserver workers import the loaders module afresh, so the counter patched
    here sees only this process's checks), and the worker's error keeps its message."""
    from fedst.data.clips import loaders

    site = write_site("D", videos={"v1": 3}, size=(16, 20))
    dataset = ClipDataset(
        GenericLayoutSource(site.root, "D"), "train", ClipConfig(num_frames=1, image_size=(16, 20))
    )
    checks_here = []
    check = loaders.check_label_values

    def counted(*args, **kwargs):
        checks_here.append(args[3])
        return check(*args, **kwargs)

    monkeypatch.setattr(loaders, "check_label_values", counted)
    bad_labels = r"batch \[.*\]: labels must be in \[0, 3\) or 255; got value\(s\) \[3\]"
    stream = BatchStream(dataset, batch_size=2, seed=0, num_workers=1, num_classes=3)
    try:
        with pytest.raises(ValueError, match=bad_labels):
            stream.next_batch()
    finally:
        stream.close()
    assert checks_here == []
    with pytest.raises(ValueError, match=bad_labels):  # no workers: the same check, here
        BatchStream(dataset, batch_size=2, seed=0, num_workers=0, num_classes=3).next_batch()
    assert len(checks_here) == 1


def test_kept_evaluation_loaders_reuse_their_workers_across_evaluations(write_site):
    """issue 60, item 4: a site's evaluation starts its loader workers once per run."""
    site = write_site("D", videos={"v1": 4})
    dataset = ClipDataset(GenericLayoutSource(site.root, "D"), "test", ClipConfig(), NO_AUGMENT)
    frames = [(0, position, True) for position in range(4)]
    loaders = FrameLoaders()
    loader = loaders.loader(dataset, frames, 2, 1)
    first = [indices for _, _, indices in loader]
    workers = loader._iterator  # the persistent workers' iterator, made by the first pass
    again = loaders.loader(dataset, frames, 2, 1)
    assert again is loader and [indices for _, _, indices in again] == first == [[0, 1], [2, 3]]
    assert again._iterator is workers and workers._workers_status == [True]  # not restarted
    assert loaders.loader(dataset, frames[:2], 2, 1) is not loader  # another plan: its own
    assert len(loaders) == 2
    loaders.close()
    assert len(loaders) == 0 and workers._workers_status == [False]
