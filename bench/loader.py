"""Clip loading throughput (clips/s) of ClipDataset: batch 2, 4-frame clips, augmentation on.

Default: two temporary generic-layout sites written by the test fixture writer
(tests/conftest.py): 1280x1024 frames resized to 512x640, and 128x160 frames (the demo size).
With --root/--site, the site's train split is measured at each --image-size instead.

``--schedule``: what the training loop waits for (issue 60, item 4), per setting and worker
count: a :class:`BatchStream` (the site's loader) read between simulated steps of ``--step-ms``
(the GPU's step; 45 ms: the H200's isolated bf16 step at 512x640): its first batch (worker start
included), the steady wait per ``next_batch`` call and its ratio to the step (target <= 5 %), the
first batch of a later round after ``--pause-s`` of other sites' work (target <= 20 ms); and an
evaluation's kept frame loader (``FrameLoaders``, batch 8): its start at the first evaluation
and at a later one (to the first batch; target <= 2 s) and its steady seconds per batch.

    .venv/bin/python -m bench.loader                       # both temporary sites, 0 and 2 workers
    .venv/bin/python -m bench.loader --root data/proc --site D --image-size 128x160
    .venv/bin/python -m bench.loader --schedule --workers 2 4   # the loop's waits and the ratios
    .venv/bin/python -m bench.loader --schedule --cache --workers 2   # with the frame cache too

``--cache`` (with ``--schedule``): each setting is measured again from the preprocessed frame
cache (fedst/data/clips/cache.py: frames decoded and resized once, read memory-mapped; built in
the temporary folder, its build time printed), in the same run: the fork server started first,
then ``--repeats`` measurements of each loader alternately, and the medians with their ratios
cached / decoding printed.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the fixture writer lives in tests/conftest.py

from conftest import write_generic_site  # noqa: E402

from fedst.data.clips import (  # noqa: E402
    AugmentConfig,
    BatchStream,
    ClipConfig,
    ClipDataset,
    FrameLoaders,
    make_loader,
)
from fedst.data.clips.cache import CachedSource  # noqa: E402
from fedst.data.clips.cache_build import build_site_cache  # noqa: E402
from fedst.data.generic import GenericLayoutSource  # noqa: E402

BATCH_SIZE = 2
WARMUP_BATCHES = 2


def parse_size(text: str) -> tuple[int, int]:
    """ "HxW" -> (H, W)."""
    height, width = text.lower().split("x")
    return int(height), int(width)


def measure(dataset: ClipDataset, num_workers: int, batches: int, seed: int) -> float:
    """Clips per second over ``batches`` batches after a warm-up (worker start-up excluded)."""
    loader = make_loader(
        dataset, BATCH_SIZE, shuffle=True, num_workers=num_workers, seed=seed, drop_last=True
    )
    batches_forever = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
    for _ in range(WARMUP_BATCHES):
        next(batches_forever)
    start = time.perf_counter()
    for _ in range(batches):
        next(batches_forever)
    elapsed = time.perf_counter() - start
    return batches * BATCH_SIZE / elapsed


def loop_waits(
    dataset: ClipDataset, num_workers: int, batches: int, step_s: float, pause_s: float
) -> dict[str, float]:
    """Seconds the training loop waits for a :class:`BatchStream`'s batches: the first (worker
    start), the mean of ``batches`` steady calls each after a step of ``step_s``, and the first
    call of a later round after ``pause_s`` (the other sites' rounds)."""
    stream = BatchStream(dataset, BATCH_SIZE, seed=0, num_workers=num_workers, num_classes=8)
    try:
        started = time.perf_counter()
        stream.next_batch()
        first = time.perf_counter() - started
        waits = []
        for _ in range(WARMUP_BATCHES + batches):
            time.sleep(step_s)  # the device's step; the host is free meanwhile
            waited = time.perf_counter()
            stream.next_batch()
            waits.append(time.perf_counter() - waited)
        time.sleep(pause_s)
        waited = time.perf_counter()
        stream.next_batch()
        next_round = time.perf_counter() - waited
    finally:
        stream.close()
    return {"first": first, "steady": sum(waits[WARMUP_BATCHES:]) / batches, "round": next_round}


def evaluation_waits(dataset: ClipDataset, num_workers: int, batches: int) -> dict[str, float]:
    """A site's kept evaluation loader (:class:`FrameLoaders`, batch 8 frames): seconds to the
    first batch of the first evaluation (worker start included) and of a later one (the kept
    workers), and per later batch (mean of at most ``batches``)."""
    plan = [
        (v, p, True) for v, video in enumerate(dataset.videos) for p in range(len(video.frames))
    ]
    loaders = FrameLoaders()
    try:
        starts, per_batch, timed = [], 0.0, 0
        for _ in range(2):  # two evaluations
            started = time.perf_counter()
            batches_of_pass = iter(loaders.loader(dataset, plan, 8, num_workers))
            next(batches_of_pass)
            starts.append(time.perf_counter() - started)
            started, timed = time.perf_counter(), 0
            for _ in itertools.islice(batches_of_pass, batches):
                timed += 1
            per_batch = (time.perf_counter() - started) / max(timed, 1)
    finally:
        loaders.close()
    return {"start": starts[0], "restart": starts[1], "per_batch": per_batch, "batches": timed}


def print_schedule(
    name: str, dataset: ClipDataset, args: argparse.Namespace
) -> dict[int, tuple[dict[str, float], dict[str, float]]]:
    """Measure and print :func:`loop_waits` and :func:`evaluation_waits` per worker count;
    returns them by worker count."""
    step_s = args.step_ms / 1000
    measured = {}
    for num_workers in args.workers:
        loop = loop_waits(dataset, num_workers, args.batches, step_s, args.pause_s)
        evaluation = evaluation_waits(dataset, num_workers, args.batches)
        measured[num_workers] = (loop, evaluation)
        print(
            f"site {name}, workers {num_workers}, step {args.step_ms:.0f} ms: first batch "
            f"{loop['first']:.2f} s; steady wait {1000 * loop['steady']:.1f} ms per call = "
            f"{loop['steady'] / step_s:.3f} x the step (target <= 0.05); first batch of a later "
            f"round {1000 * loop['round']:.1f} ms (target <= 20); evaluation loader start "
            f"{evaluation['start']:.2f} s at the first evaluation, "
            f"{evaluation['restart']:.2f} s at a later one (kept workers; target <= 2), then {1000 * evaluation['per_batch']:.0f} "
            f"ms per batch of 8 frames ({evaluation['batches']} batches)"
        )
    return measured


def cached_dataset(dataset: ClipDataset, cache_dir: Path) -> ClipDataset:
    """``dataset`` read from the frame cache (fedst/data/clips/cache.py), built here into
    ``cache_dir`` from its split; prints the build's seconds."""
    started = time.perf_counter()
    summary = build_site_cache(dataset.source, [dataset.split], dataset.clip, cache_dir)
    print(
        f"site {dataset.site_name}: cache of {summary.frames} frames at "
        f"{dataset.clip.image_size[0]}x{dataset.clip.image_size[1]} built in "
        f"{time.perf_counter() - started:.2f} s ({summary.megabytes:.1f} MiB)"
    )
    source = CachedSource(dataset.source, cache_dir)
    return ClipDataset(source, dataset.split, dataset.clip, AugmentConfig(), validate=False)


def print_clip_costs(decoded: ClipDataset, cached: ClipDataset, passes: int = 2) -> None:
    """Milliseconds per clip of :meth:`ClipDataset.load_raw` in this process (no workers),
    with the augmentation on and off, decoding and from the cache: what a worker spends."""
    for augment in (AugmentConfig(), None):
        costs = {}
        for name, dataset in (("decoding", decoded), ("cache", cached)):
            dataset = ClipDataset(dataset.source, "train", dataset.clip, augment, validate=False)
            dataset.load_raw((0, 0))  # the memory maps open, the pipeline is built
            started = time.perf_counter()
            for index, aug_seed in itertools.product(range(len(dataset)), range(passes)):
                dataset.load_raw((index, aug_seed))
            costs[name] = (time.perf_counter() - started) / (len(dataset) * passes)
        print(
            f"  load_raw per clip in process, augmentation {'on' if augment else 'off'}: "
            f"decoding {1000 * costs['decoding']:.1f} ms, frame cache "
            f"{1000 * costs['cache']:.1f} ms (x {costs['cache'] / costs['decoding']:.3f})"
        )


def print_cache_ratios(decoded: list[dict], cached: list[dict]) -> None:
    """Medians over the repeats of the decoding and the cached loader's waits (each repeat: a
    :func:`print_schedule` result), and their ratios cached / decoding."""
    loop_keys = (("steady", "steady wait per call"), ("first", "first batch"))
    loop_keys += (("round", "first batch of a later round"),)
    evaluation_keys = (("start", "evaluation start"), ("restart", "evaluation restart"))
    for num_workers in decoded[0]:
        parts = []
        for index, keys in ((0, loop_keys), (1, evaluation_keys)):
            for key, label in keys:
                old = statistics.median(r[num_workers][index][key] for r in decoded)
                new = statistics.median(r[num_workers][index][key] for r in cached)
                parts.append(f"{label} {1000 * old:.1f} -> {1000 * new:.1f} ms (x {new / old:.3f})")
        print(
            f"  median of {len(decoded)}, decoding -> frame cache, workers {num_workers}: "
            + "; ".join(parts)
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="generic-layout root (default: temporary sites)")
    parser.add_argument("--site", help="site folder under --root")
    parser.add_argument(
        "--image-size", type=parse_size, action="append", help="HxW network input, repeatable"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batches", type=int, default=20, help="timed batches per setting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schedule", action="store_true", help="the loop's waits (docstring)")
    parser.add_argument("--step-ms", type=float, default=45.0, help="--schedule: the step")
    parser.add_argument("--pause-s", type=float, default=1.0, help="--schedule: between rounds")
    parser.add_argument(
        "--cache",
        action="store_true",
        help="--schedule: measure each setting again reading the frame cache (built in a "
        "temporary folder) and print the ratios",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="--cache: alternating measurements per loader"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        if args.root is not None:
            if args.site is None:
                parser.error("--root needs --site")
            sizes = args.image_size or [(512, 640), (128, 160)]
            settings = [(GenericLayoutSource(args.root, args.site), size) for size in sizes]
        else:
            videos = {"v1": 8, "v2": 8}
            big = write_generic_site(Path(tmp), "big", videos, size=(1024, 1280))
            small = write_generic_site(Path(tmp), "small", videos, size=(128, 160))
            settings = [
                (GenericLayoutSource(big.root, "big"), (512, 640)),
                (GenericLayoutSource(small.root, "small"), (128, 160)),
            ]
        for source, size in settings:
            dataset = ClipDataset(source, "train", ClipConfig(image_size=size), AugmentConfig())
            frame = source.read_frame(dataset.videos[0].frames[0])
            if args.schedule:
                name = f"{source.name} {size[0]}x{size[1]}"
                if not args.cache:
                    print_schedule(name, dataset, args)
                    continue
                cached = cached_dataset(dataset, Path(tmp) / f"cache_{size[0]}x{size[1]}")
                if max(args.workers) > 0:  # the fork server starts once, before either is timed
                    loop_waits(dataset, 1, 1, 0.0, 0.0)
                measured: dict[str, list] = {"decoding": [], "cache": []}
                for _ in range(args.repeats):  # alternately: a change of load hits both
                    measured["decoding"].append(print_schedule(name, dataset, args))
                    measured["cache"].append(print_schedule(f"{name} (frame cache)", cached, args))
                print_cache_ratios(measured["decoding"], measured["cache"])
                print_clip_costs(dataset, cached)
                continue
            for num_workers in args.workers:
                rate = measure(dataset, num_workers, args.batches, args.seed)
                print(
                    f"site {source.name}: frames {frame.shape[0]}x{frame.shape[1]} -> "
                    f"{size[0]}x{size[1]}, T={dataset.clip_length}, batch {BATCH_SIZE}, "
                    f"augment on, workers {num_workers}: {rate:.1f} clips/s "
                    f"({args.batches} batches)"
                )


if __name__ == "__main__":
    main()
