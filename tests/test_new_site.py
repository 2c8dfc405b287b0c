"""Specification of scoring a new site (external validation): ``eval_outfed.py run=RUN
site_root=FOLDER`` scores a site folder in the generic layout that the run's config never listed,
with the out-of-federation model prompted as that site, and writes only ``RUN/external/``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from fedst import weights
from fedst.cli import check_method, register_resolvers, split_config
from fedst.config import ConfigError
from fedst.data.base import DataError
from fedst.data.procedural import generate
from fedst.experiment import ExperimentConfig
from fedst.model import indicators
from fedst.model.indicators import IndicatorUnavailableError
from fedst.runs import Run
from fedst.runs.outfed import evaluate_out_of_federation, new_site_indicator, open_new_site
from fedst.training import run_training
from tests.conftest import classifier_bias

REPO = Path(__file__).resolve().parents[1]
TINY_PROMPTS = {  # configs/data/tiny.yaml: site -> surgery type, written out by hand
    "A": "nephrectomy",
    "B": "nephrectomy",
    "C": "prostatectomy",
    "D": "hysterectomy",
    "E": "lobectomy",
    "grasp": "prostatectomy",
    "synthetic": "gastrectomy",
}
LUNG_PROMPT = "This is the Local site lung model and the surgery type is lobectomy"
CLIP_CACHE_FILE = "clip_text_ViT-B-32_openai.json"
QUIET = ("progress=false",)


def experiment(root: Path, *overrides: str) -> ExperimentConfig:
    register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=tiny", f"data.root={root}", *overrides])
    config = split_config(cfg)[0]
    check_method(config)  # as train_fed.py, right after the config parses
    return config


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


BACKGROUND_BIAS_SHIFT = -5.0
"""Added to the saved site models' background logit bias (-2 before issue 58's temporal module and
optimizer groups; -5 since): after 4 iterations the model predicts
background everywhere (Dice 0 on every site, which any two evaluation paths agree on); shifted, it
predicts instruments, so the scores depend on the pixels, the prompt and the model."""


@pytest.fixture(scope="module")
def clip_run(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished 2-round FedST run with CLIP indicators read from a cache this fixture writes
    (random unit vectors; the new site "lung" (lobectomy) shares site E's vector), its saved
    global model's background bias shifted by BACKGROUND_BIAS_SHIFT. Returns (run directory,
    cache file)."""
    cache_dir = tmp_path_factory.mktemp("clip_cache")
    generator = torch.Generator().manual_seed(7)
    cache = {}
    for site, surgery in TINY_PROMPTS.items():
        vector = torch.randn(512, generator=generator)
        cache[f"This is the Local site {site} model and the surgery type is {surgery}"] = (
            vector / vector.norm()
        ).tolist()
    cache[LUNG_PROMPT] = cache["This is the Local site E model and the surgery type is lobectomy"]
    (cache_dir / CLIP_CACHE_FILE).write_text(json.dumps(cache))
    cfg = experiment(tiny_root, "method.indicator=clip", f"indicator.cache_dir={cache_dir}")
    run_dir = tmp_path_factory.mktemp("runs") / "fedst_clip"
    run_training(cfg, run_dir, progress=False)
    last = torch.load(run_dir / "checkpoints" / "server.pt", weights_only=False)["round"]
    for site in cfg.data.federation:  # FedST returns each site's own gamma_k: shift every one
        state_path = run_dir / "sites" / site / f"state_r{last:04d}.pt"
        state = torch.load(state_path, weights_only=False)
        state["shared"][classifier_bias(state["shared"])][0] += BACKGROUND_BIAS_SHIFT
        torch.save(state, state_path)
    return run_dir, cache_dir / CLIP_CACHE_FILE


@pytest.fixture(scope="module")
def lung_site(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Site E's files copied to another hospital's folder ``.../hospital/lung``, as a plain
    generic-layout site (meta.json without the generator's record)."""
    folder = tmp_path_factory.mktemp("hospital") / "lung"
    shutil.copytree(tiny_root / "E", folder)
    meta = json.loads((folder / "meta.json").read_text())
    del meta["generator"]
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def test_a_new_site_scores_as_the_configured_out_of_federation_path_on_the_same_data(
    clip_run, lung_site
):
    run_dir, _ = clip_run
    before = {name: (run_dir / name).read_bytes() for name in ("config.json", "final.json")}
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "HF_HUB_OFFLINE": "1"}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "eval_outfed.py", f"run={run_dir}", f"site_root={lung_site}", *QUIET],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("| lung | lobectomy |")
    new = json.loads((run_dir / "external" / "lung.json").read_text())

    # Independent path: the run's own config, where E (the same pixels) is a configured site.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess: bit-identical float sums
    try:
        reference = evaluate_out_of_federation(Run(run_dir), torch.device("cpu"), sites=("E",))[
            "E"
        ].summary
    finally:
        torch.set_num_threads(threads)
    assert reference["dice"] > 1.0  # not the all-background model: the comparison can fail
    for metric in ("dice", "iou", "hd95", "assd", "num_frames"):
        assert new["summary"][metric] == pytest.approx(reference[metric], abs=1e-9), metric
    assert new["prompt"] == LUNG_PROMPT
    assert "| lung | lobectomy |" in (run_dir / "external" / "results.md").read_text()
    assert {name: (run_dir / name).read_bytes() for name in before} == before


def test_a_new_site_is_prompted_with_its_own_name_and_surgery_type(clip_run, lung_site):
    run_dir, cache_file = clip_run
    run = Run(run_dir)
    site = open_new_site(run, lung_site)
    assert (site.name, site.surgery_type) == ("lung", "lobectomy")  # folder name, meta.json

    pleura = "This is the Local site pleura model and the surgery type is wedge resection"
    cache = json.loads(cache_file.read_text())
    cache[pleura] = [0.0] * 511 + [1.0]  # a vector no other prompt has
    cache_file.write_text(json.dumps(cache))
    site = open_new_site(run, lung_site, site_name="pleura", surgery_type="wedge resection")
    vector = new_site_indicator(run, site.name, site.surgery_type)
    assert torch.equal(vector, torch.tensor(cache[pleura], dtype=torch.float32))


def test_an_unknown_surgery_type_without_clip_says_how_to_prepare_it(
    clip_run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FEDST_WEIGHTS_DIR", str(tmp_path / "no_weights"))
    run_dir, _ = clip_run
    with pytest.raises(IndicatorUnavailableError) as err:
        new_site_indicator(Run(run_dir), "lung", "pneumonectomy")
    message = str(err.value)
    assert "This is the Local site lung model and the surgery type is pneumonectomy" in message
    assert (
        f"python -m fedst.weights --run {run_dir} --extra-site lung:pneumonectomy --prepare"
        in message
    )


def test_prepare_with_an_extra_site_builds_the_prompt_the_new_site_evaluation_reads(
    clip_run, monkeypatch: pytest.MonkeyPatch
):
    run_dir, _ = clip_run
    encoded: list[str] = []

    def encode(prompts, clip_model, clip_pretrained, cache_path, weights_dir):
        encoded.extend(prompts)
        return {p: [1.0] + [0.0] * 511 for p in prompts}

    monkeypatch.setattr(indicators, "_encode_prompts", encode)
    code = weights.main(["--run", str(run_dir), "--extra-site", "lung:segmentectomy", "--prepare"])
    assert code == 0
    assert encoded == ["This is the Local site lung model and the surgery type is segmentectomy"]

    def forbidden(*args, **kwargs):
        raise AssertionError("the evaluation had to embed a prompt: prepare wrote another cache")

    monkeypatch.setattr(indicators, "_encode_prompts", forbidden)
    vector = new_site_indicator(Run(run_dir), "lung", "segmentectomy")
    assert vector[0] == 1.0 and float(vector.abs().sum()) == 1.0


def test_a_new_sites_one_hot_indicator_is_a_slot_no_site_of_the_run_has(tiny_root, tmp_path):
    # indicator.unseen=own; configs/data/tiny.yaml lists 7 sites (ids 0..6)
    cfg = experiment(tiny_root, "indicator.unseen=own")
    vector = new_site_indicator(Run(tmp_path, cfg), "lung", "lobectomy")
    assert int(vector.argmax()) == 7 and float(vector.sum()) == 1.0


@pytest.mark.parametrize("kind", ["onehot", "gaussian", "random"])
def test_under_the_fold_rule_a_new_site_gives_no_indicator_and_gaussian_runs_accept_it(
    tiny_root, tmp_path, kind
):
    cfg = experiment(tiny_root, f"method.indicator={kind}")  # auto: fold
    vector = new_site_indicator(Run(tmp_path, cfg), "lung", "lobectomy")
    assert vector.shape == (cfg.indicator.dim,) and vector.abs().sum() == 0


def test_a_gaussian_run_refuses_a_new_site_only_under_the_own_rule(tiny_root, tmp_path):
    cfg = experiment(tiny_root, "method.indicator=gaussian", "indicator.unseen=own")
    with pytest.raises(ConfigError, match="unseen_indicator=fold"):
        new_site_indicator(Run(tmp_path, cfg), "lung", "lobectomy")


# -- clear errors -------------------------------------------------------------------------------


@pytest.fixture
def cfg(tiny_root: Path) -> ExperimentConfig:
    return experiment(tiny_root)


def test_a_missing_folder_is_an_error_naming_it(cfg, tmp_path):
    with pytest.raises(DataError, match=r"site_root=.*nowhere: folder does not exist"):
        open_new_site(Run("run-not-read", cfg), tmp_path / "nowhere")


def test_a_folder_of_sites_is_an_error_naming_the_site_folder_to_pass(cfg, write_site, tmp_path):
    write_site("lung", videos={"v1": 4})
    with pytest.raises(DataError, match=r"holds the site folder\(s\) \['lung'\]: pass one"):
        open_new_site(Run("run-not-read", cfg), tmp_path)


def test_a_wrong_layout_is_an_error_naming_the_file_and_line(cfg, write_site):
    site = write_site("lung", videos={"v1": 4})
    meta = json.loads((site.site_dir / "meta.json").read_text())
    del meta["surgery_type"]
    (site.site_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"lung/meta\.json: missing key\(s\) \['surgery_type'\]"):
        open_new_site(Run("run-not-read", cfg), site.site_dir)

    site = write_site("lung2", videos={"v1": 4})
    (site.site_dir / "splits" / "test.txt").write_text("v1\nghost\n")
    with pytest.raises(DataError, match=r"test\.txt: lists unknown video 'ghost' on line 2"):
        open_new_site(Run("run-not-read", cfg), site.site_dir)


def test_a_site_without_test_split_is_an_error_saying_what_to_write(cfg, write_site):
    site = write_site("lung", videos={"v1": 4}, splits={"train": ["v1"]})
    with pytest.raises(DataError, match=r"splits/test\.txt: the site has no test split"):
        open_new_site(Run("run-not-read", cfg), site.site_dir)


def test_a_name_the_run_already_has_is_an_error(cfg, write_site):
    site = write_site("lung", videos={"v1": 4})
    with pytest.raises(ConfigError, match=r"site_name='E' is already a site of this run"):
        open_new_site(Run("run-not-read", cfg), site.site_dir, site_name="E")
