"""Specification of the int8 export (fedst/quantize.py): parity with the fp32 graph within a stated
tolerance, no int8 graph without calibration, calibration on the training split only, an exact
(fp32) feature cache, and `fedst.infer runtime=onnx-int8`.

The model is a randomly initialised tiny FedST network at 64x80 fed Gaussian-noise frames: no
margin between its classes, the hardest case for the argmax agreement. The tolerance is
fedst.quantize's (MIN_PIXEL_AGREEMENT, MAX_LOGIT_ERROR); the test that calibrates on constant
frames shows it is tight enough to catch a graph whose calibration was skipped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import record_reads, write_generic_site
from hydra import compose, initialize_config_dir

from fedst.cli import register_resolvers, split_config
from fedst.export import OnnxStreamer, export_onnx
from fedst.export import main as export_main
from fedst.infer import InferConfig, InferenceError, run_inference
from fedst.methods import method_of
from fedst.model.network import NetworkConfig, build_network
from fedst.model.state import state_subset
from fedst.onnx_stream import context_input_name, feature_output_name
from fedst.quantize import (
    MAX_LOGIT_ERROR,
    MIN_PIXEL_AGREEMENT,
    CalibrationError,
    compare_logits,
    quantize_step,
    training_videos,
)
from fedst.runs.layout import SERVER_CHECKPOINT, site_state_dir, site_state_file
from fedst.storage import atomic_torch_save
from fedst.training import save_config

pytest.importorskip("onnxruntime")

SIZE = (64, 80)
DIM = 16
TINY = NetworkConfig(indicator_dim=DIM, decoder_dim=32, drop_path_rate=0.0)
FPS = 25.0
REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def fp32_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    net = build_network(TINY).eval()
    indicator = torch.nn.functional.normalize(torch.arange(DIM, dtype=torch.float32), dim=0)
    return export_onnx(net, indicator, SIZE, 0.2, tmp_path_factory.mktemp("fp32") / "step.onnx")


def noise_frames(seed: int, count: int) -> np.ndarray:
    """[count, 1, 3, H, W] float32 frames of Gaussian noise (normalised-input scale)."""
    generator = np.random.default_rng(seed)
    return generator.standard_normal((count, 1, 3, *SIZE)).astype(np.float32)


def streamed_feeds(fp32: Path, frames: np.ndarray) -> list[dict[str, np.ndarray]]:
    """The graph's inputs at each frame (1/25 s apart), the context cached by the fp32 graph."""
    streamer, feeds = OnnxStreamer(fp32, threads=1), []
    for index, frame in enumerate(frames):
        feeds.append(streamer.feeds(frame, index / FPS))
        streamer.run(feeds[-1], index / FPS)
    return feeds


def streamed_logits(graph: Path, frames: np.ndarray) -> list[np.ndarray]:
    streamer = OnnxStreamer(graph, threads=1)
    return [streamer.step(frame, index / FPS) for index, frame in enumerate(frames)]


# -- parity --------------------------------------------------------------------------------------


def test_int8_streaming_matches_fp32_within_the_stated_tolerance(fp32_step, tmp_path):
    calibration = streamed_feeds(fp32_step, noise_frames(seed=1, count=8))
    int8 = quantize_step(fp32_step, tmp_path / "step.int8.onnx", iter(calibration))
    frames = noise_frames(seed=2, count=8)  # past the 0.6 s clip span: the cache is reused
    parity = compare_logits(streamed_logits(fp32_step, frames), streamed_logits(int8, frames))
    assert parity.pixel_agreement >= MIN_PIXEL_AGREEMENT, parity.describe()
    assert parity.logit_error <= MAX_LOGIT_ERROR, parity.describe()
    assert parity.within_tolerance


def test_a_graph_calibrated_on_constant_frames_breaks_the_tolerance(fp32_step, tmp_path):
    """What skipping calibration gives (ranges of nothing real): the tolerance must catch it."""
    constant = [
        {name: np.zeros_like(v) if v.dtype == np.float32 else v for name, v in feeds.items()}
        for feeds in streamed_feeds(fp32_step, noise_frames(seed=1, count=4))
    ]
    int8 = quantize_step(fp32_step, tmp_path / "step.int8.onnx", iter(constant))
    frames = noise_frames(seed=2, count=8)
    parity = compare_logits(streamed_logits(fp32_step, frames), streamed_logits(int8, frames))
    assert not parity.within_tolerance, parity.describe()


def test_compare_logits_counts_argmax_agreement_per_frame_and_the_relative_rms_error():
    fp32 = [np.array([[[[1.0, 0.0]], [[0.0, 1.0]]]], np.float32)]  # [1, K=2, 1, 2]: classes 0, 1
    int8 = [np.array([[[[1.0, 2.0]], [[0.0, 1.0]]]], np.float32)]  # pixel 2 becomes class 0
    parity = compare_logits(fp32, int8)
    assert parity.pixel_agreement == 0.5 and parity.mean_agreement == 0.5
    assert parity.logit_error == pytest.approx((4 / 2) ** 0.5)  # sqrt(2^2 / (1 + 1))


# -- no int8 without calibration -------------------------------------------------------------------


@pytest.mark.parametrize("feeds", [None, iter([])], ids=["no calibration", "empty calibration"])
def test_the_int8_export_refuses_to_quantize_without_calibration_frames(fp32_step, tmp_path, feeds):
    out = tmp_path / "step.int8.onnx"
    with pytest.raises(CalibrationError, match="calibration"):
        quantize_step(fp32_step, out, feeds)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary folder


def test_calibration_frames_below_one_is_refused_before_anything_is_read():
    class Unread:
        name = "A"

        def videos(self, split):
            raise AssertionError("no frame should be read")

    with pytest.raises(CalibrationError, match="calibration_frames=0"):
        training_videos([Unread()], 0, 4, 0.2)


# -- the command: training split only, an exact cache, fedst.infer runtime=onnx-int8 --------------


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny run of one round (config, server checkpoint, site states; random init) whose site A
    has a training video t1 and a test video s1, and its int8 export, made by the command with the
    frames it read recorded: (run directory, frames read)."""
    register_resolvers()
    root = tmp_path_factory.mktemp("data")
    splits = {"train": ["t1"], "val": ["t1"], "test": ["s1"]}
    write_generic_site(root, "A", videos={"t1": 12, "s1": 12}, size=(48, 64), splits=splits)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = split_config(compose("config", overrides=["experiment=tiny", f"data.root={root}"]))[0]
    run = tmp_path_factory.mktemp("runs") / "fedst"
    save_config(cfg, run)
    torch.manual_seed(0)
    model = method_of(cfg).build_model()
    partition = method_of(cfg).partition(model)
    checkpoint = {
        "round": 1,
        "global_model": model.state_dict(),
        "shared_keys": list(partition.shared),
        "serq": None,
        "extra": {},
    }
    atomic_torch_save(checkpoint, run / SERVER_CHECKPOINT)
    for site in cfg.data.federation:
        state = {
            "personal": state_subset(model, partition.personal),
            "shared": state_subset(model, partition.shared),
            "num_examples": 4,
        }
        atomic_torch_save(state, site_state_file(site_state_dir(run, site), 1))
    with pytest.MonkeyPatch.context() as patch:
        read = record_reads(patch)
        export_main([f"run={run}", "site=A", "format=onnx-int8", "calibration_frames=6"])
    return run, list(read)


def test_the_int8_export_reads_only_the_training_split(int8_run):
    _, read = int8_run
    assert read, "the export read no calibration frame"
    assert {path.parent.parent.name for path in read} == {"t1"}


def test_the_int8_sidecar_records_the_calibration_set_and_what_stayed_fp32(int8_run):
    run, _ = int8_run
    meta = json.loads((run / "export" / "A.int8.json").read_text())
    quantization = meta["quantization"]
    assert quantization["calibration"]["sites"] == ["A"]
    assert quantization["calibration"]["split"] == "train"
    assert quantization["calibration"]["frames"] == 6
    assert quantization["calibration"]["videos"] == ["A/t1"]
    assert quantization["kept_fp32_modules"] == ["net.temporal"]
    assert quantization["quantized_ops"]["Conv"] > 0
    assert meta["source"] == {"run": str(run), "site": "A", "prompt_site": None}


def test_the_feature_cache_stays_fp32_in_and_out_and_the_temporal_module_is_not_quantized(int8_run):
    import onnx

    run, _ = int8_run
    graph = onnx.load(str(run / "export" / "A.int8.onnx")).graph
    float32 = onnx.TensorProto.FLOAT
    keys = json.loads((run / "export" / "A.int8.json").read_text())["temporal_stages"]
    names = {context_input_name(k) for k in keys} | {feature_output_name(k) for k in keys}
    cache = [v for v in [*graph.input, *graph.output] if v.name in names]
    assert len(cache) == 2 * len(keys) == 2  # the decode head's fused maps, in and out
    assert cache and all(v.type.tensor_type.elem_type == float32 for v in cache)
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    assert not [v.name for v in cache if v.name in dequantized]  # features_* not 8-bit copies
    temporal = [n for n in graph.node if "net.temporal" in _scopes(n)]
    assert temporal
    assert not [n.name for n in temporal if any(i in dequantized for i in n.input)]


def _scopes(node) -> str:
    return next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), "")


def _video(tmp_path: Path) -> Path:
    folder = tmp_path / "frames"
    write_generic_site(tmp_path, "V", videos={"v": 6}, size=(48, 64))
    (tmp_path / "V" / "videos" / "v" / "frames").rename(folder)
    return folder


def _site_a_video(run: Path, tmp_path: Path, **options) -> InferConfig:
    """Inference of site A's model on a short synthetic video, with the runtime ``options``."""
    return InferConfig(
        run=str(run),
        site="A",
        input=str(_video(tmp_path)),
        fps=5,
        output=str(tmp_path / "out"),
        progress=False,
        **options,
    )


def test_infer_runs_the_int8_graph_and_its_summary_names_the_runtime(int8_run, tmp_path):
    run, _ = int8_run
    summary = run_inference(_site_a_video(run, tmp_path, runtime="onnx-int8", threads=1))
    assert summary["frames"] == 6
    assert summary["network"]["runtime"] == "onnx-int8"
    assert summary["network"]["onnx_file"] == str(run / "export" / "A.int8.onnx")
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["network"]["runtime"] == "onnx-int8"


def test_infer_refuses_an_int8_graph_asked_for_as_fp32(int8_run, tmp_path):
    run, _ = int8_run
    config = _site_a_video(
        run, tmp_path, runtime="onnx", onnx_file=str(run / "export" / "A.int8.onnx")
    )
    with pytest.raises(InferenceError, match="holds the onnx-int8 graph but runtime=onnx"):
        run_inference(config)
    missing = dataclasses.replace(config, onnx_file=None)
    with pytest.raises(InferenceError, match="format=onnx"):
        run_inference(missing)  # no A.onnx was exported: the message gives the command
    assert not (tmp_path / "out").exists()
