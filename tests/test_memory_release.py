"""Specification of fedst.accel.release_free_memory: the heap's free pages go back to the
operating system, which glibc does not do by itself for memory freed below the top of its heap
(what a CPU training step's activations leave behind between phases)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

MB = 2**20

# In a fresh interpreter, two training steps of 6 conv + GELU layers on [2, 16, 256, 256]: each
# step saves 12 activations of 2 x 16 x 256 x 256 x 4 B = 8 MiB (96 MiB) for its backward and frees
# them afterwards. glibc keeps such freed pages in its heap (tensors under its dynamic mmap
# threshold), so they stay resident until released.
TRAINING_STEPS = textwrap.dedent(
    """
    import json, torch
    from torch import nn
    from fedst.accel import memory_usage, release_free_memory
    torch.set_num_threads(1)
    layers = [m for _ in range(6) for m in (nn.Conv2d(16, 16, 3, padding=1), nn.GELU())]
    net, x = nn.Sequential(*layers), torch.randn(2, 16, 256, 256)
    for _ in range(2):
        net(x).square().mean().backward()
    before = memory_usage()["rss_bytes"]
    released = release_free_memory()
    after = memory_usage()["rss_bytes"]
    print(json.dumps({"before": before, "released": released, "after": after}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_activations_a_training_step_freed_leave_the_resident_set_when_released():
    done = subprocess.run(
        [sys.executable, "-c", TRAINING_STEPS], capture_output=True, text=True, check=True
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    # at least two thirds of one step's 96 MiB of activations go back to the system
    assert figures["released"] >= 64 * MB
    assert figures["before"] - figures["after"] >= 64 * MB
