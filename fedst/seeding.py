"""One seeding rule for every party: a tuple of integers (seed, site index, round, ...) -> seeds."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(*parts: int) -> None:
    """Seed Python, NumPy and torch from a tuple of integers (seed, site index, round, ...)."""
    seed = int(np.random.SeedSequence(list(parts)).generate_state(1)[0])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
