"""Specification of the E-floor diagnosis plan (studies/outfed_floor/outfed_floor.py): every row is a valid
train_fed.py config, every method gets the same budgets and the same variants, and the oracle
trains on the oracle split alone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from fedst.cli import compose_experiment

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def floor():
    spec = importlib.util.spec_from_file_location(
        "outfed_floor", REPO / "studies/outfed_floor/outfed_floor.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["outfed_floor"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(floor):
    oracle = (
        "method=local",
        "data.federation=[E_oracle]",
        "+data.sites.E_oracle={backend:generic,root:/somewhere/demo_oracle,surgery_type:lobectomy}",
    )
    return floor.plan(
        ["oracle", "fedavg", "fedst"],
        [1, 4, 16],
        [1, 4],
        ("experiment=demo", "seed=0"),
        400,
        4,
        oracle,
    )


def test_every_method_gets_every_budget_and_both_variants(rows):
    for method in ("oracle", "fedavg", "fedst"):
        mine = {(r.budget, r.photometric, r.pretraining) for r in rows if r.method == method}
        assert mine == {(1, False, True), (4, False, True), (16, False, True)} | {
            (k, True, True) for k in (1, 4)
        } | {(k, False, False) for k in (1, 4)}


def test_a_variant_differs_from_its_base_row_only_by_its_overrides(floor, rows):
    base = {
        (r.method, r.budget): set(r.overrides) for r in rows if not r.photometric and r.pretraining
    }
    for row in rows:
        extra = set(row.overrides) - base[(row.method, row.budget)]
        missing = base[(row.method, row.budget)] - set(row.overrides)
        assert not missing
        expected = set(floor.PHOTOMETRIC if row.photometric else ()) | set(
            () if row.pretraining else floor.NO_PRETRAINING
        )
        assert extra == expected, row.name


def test_every_kind_of_row_composes_into_the_config_it_names(rows):
    for row in [r for r in rows if r.budget == 4]:  # each method and variant once
        cfg, _ = compose_experiment(list(row.overrides))
        assert cfg.train.total_iters == 400 * row.budget, row.name
        assert cfg.train.rounds == 20 * row.budget  # 20 local iterations per round (demo)
        assert cfg.train.eval_every == 4 * row.budget  # as many evaluations as the demo
        assert (cfg.augment.hue > 0) == row.photometric and (
            cfg.augment.blur_sigma > 0
        ) == row.photometric
        assert (cfg.pretraining.iters > 0) == row.pretraining
        if row.method == "oracle":
            assert cfg.data.federation == ("E_oracle",) and "E" in cfg.data.out_of_federation
            assert cfg.method.name == "local"
        else:
            assert cfg.data.federation == ("A", "B", "C", "D") and cfg.method.name == row.method
