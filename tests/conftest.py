"""Shared test fixtures: a tiny writer of generic-layout sites with known content.

``write_generic_site`` (plain function) and the ``write_site`` fixture (the same function rooted at
``tmp_path``) write ``<root>/<site>/{meta.json, videos/, splits/}`` as read by
:class:`fedst.data.generic.GenericLayoutSource`. Every frame shows a flat tissue background whose
red channel encodes the frame index (:func:`background_colour`, :func:`frame_index_from_rgb`) and
a horizontal instrument entering from the left: shaft, wrist and jaw rectangles in fixed colours
(:data:`PART_COLOURS`) whose label map is written exactly (0..3, or 0/1 for a binary site).
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import cv2
import numpy as np
import pytest
from flwr.app import Message

from tests.work_units import SHARED_RUN_FILES, pytest_xdist_make_scheduler  # noqa: F401 (a hook)

PART_COLOURS: dict[int, tuple[int, int, int]] = {
    1: (200, 200, 200),  # shaft: light grey
    2: (40, 40, 220),  # wrist: blue
    3: (240, 200, 0),  # jaw: yellow
}
BACKGROUND_RED_OFFSET = 20
MAX_ENCODED_FRAME_INDEX = 200


def background_colour(frame_index: int) -> tuple[int, int, int]:
    """RGB of frame ``frame_index``'s background; red = 20 + index (index < 200)."""
    if not 0 <= frame_index < MAX_ENCODED_FRAME_INDEX:
        raise ValueError(f"frame index {frame_index} cannot be encoded (0..199)")
    return (BACKGROUND_RED_OFFSET + frame_index, 90, 50)


def frame_index_from_rgb(rgb: Sequence[float]) -> int:
    """Inverse of :func:`background_colour` for one background pixel (RGB 0..255)."""
    return round(float(rgb[0])) - BACKGROUND_RED_OFFSET


def draw_frame(
    frame_index: int, size: tuple[int, int], binary: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(RGB uint8 [H, W, 3], label uint8 [H, W]) of one synthetic frame.

    The instrument tip advances with the frame index (period 4); the top-left corner and the top
    and bottom 25 % of rows are always background.
    """
    height, width = size
    rgb = np.empty((height, width, 3), dtype=np.uint8)
    rgb[:] = background_colour(frame_index)
    label = np.zeros((height, width), dtype=np.uint8)
    shaft_end = int(width * (0.3 + 0.05 * (frame_index % 4)))
    part_width = int(width * 0.12)
    boxes = {  # class -> (row0, row1, col0, col1)
        1: (int(0.4 * height), int(0.6 * height), 0, shaft_end),
        2: (int(0.35 * height), int(0.65 * height), shaft_end, shaft_end + part_width),
        3: (
            int(0.3 * height),
            int(0.7 * height),
            shaft_end + part_width,
            shaft_end + 2 * part_width,
        ),
    }
    for part, (r0, r1, c0, c1) in boxes.items():
        rgb[r0:r1, c0:c1] = PART_COLOURS[part]
        label[r0:r1, c0:c1] = 1 if binary else part
    return rgb, label


@dataclass
class WrittenSite:
    """What :func:`write_generic_site` wrote: the site folder and per-video frame / mask files."""

    root: Path
    name: str
    site_dir: Path
    frames: dict[str, dict[int, Path]] = field(default_factory=dict)
    masks: dict[str, dict[int, Path]] = field(default_factory=dict)


def write_generic_site(
    root: Path,
    site: str,
    videos: Mapping[str, int | Sequence[int]],
    size: tuple[int, int] = (32, 40),
    label_every: int = 1,
    fps: float = 5,
    splits: Mapping[str, Sequence[str]] | None = None,
    binary: bool = False,
    surgery_type: str = "hysterectomy",
    frame_suffix: str = ".png",
) -> WrittenSite:
    """Write a generic-layout site ``root/site`` and return what was written.

    videos: video_id -> number of frames (indices 0..n-1) or the explicit frame indices.
    label_every: frame index i gets a mask when ``i % label_every == 0``.
    splits: split -> video ids; default every video in train, val and test.
    """
    site_dir = Path(root) / site
    site_dir.mkdir(parents=True, exist_ok=True)
    classes = ["background", "instrument"] if binary else ["background", "shaft", "wrist", "jaw"]
    meta = {
        "fps": fps,
        "annotated_fps": fps / label_every,
        "classes": classes,
        "ignore_index": 255,
        "surgery_type": surgery_type,
        "binary": binary,
    }
    (site_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    written = WrittenSite(root=Path(root), name=site, site_dir=site_dir)
    for video_id, frames in videos.items():
        indices = list(range(frames)) if isinstance(frames, int) else list(frames)
        frames_dir = site_dir / "videos" / video_id / "frames"
        masks_dir = site_dir / "videos" / video_id / "masks"
        frames_dir.mkdir(parents=True, exist_ok=True)
        masks_dir.mkdir(parents=True, exist_ok=True)
        written.frames[video_id], written.masks[video_id] = {}, {}
        for index in indices:
            rgb, label = draw_frame(index, size, binary)
            frame_path = frames_dir / f"{index:09d}{frame_suffix}"
            cv2.imwrite(str(frame_path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
            written.frames[video_id][index] = frame_path
            if index % label_every == 0:
                mask_path = masks_dir / f"{index:09d}.png"
                cv2.imwrite(str(mask_path), label)
                written.masks[video_id][index] = mask_path
    (site_dir / "splits").mkdir(exist_ok=True)
    if splits is None:
        splits = {split: list(videos) for split in ("train", "val", "test")}
    for split, video_ids in splits.items():
        (site_dir / "splits" / f"{split}.txt").write_text("".join(f"{v}\n" for v in video_ids))
    return written


def record_reads(patch: pytest.MonkeyPatch) -> list[Path]:
    """Record, in the returned list, the path of every frame and label that a
    :class:`fedst.data.generic.GenericLayoutSource` reads while ``patch`` is active."""
    from fedst.data.generic import GenericLayoutSource

    read: list[Path] = []
    original_frame = GenericLayoutSource.read_frame
    original_label = GenericLayoutSource.read_label

    def read_frame(self, ref):
        read.append(ref.path)
        return original_frame(self, ref)

    def read_label(self, ref):
        read.append(ref.path)
        return original_label(self, ref)

    patch.setattr(GenericLayoutSource, "read_frame", read_frame)
    patch.setattr(GenericLayoutSource, "read_label", read_label)
    return read


@pytest.fixture
def write_site(tmp_path: Path) -> Callable[..., WrittenSite]:
    """:func:`write_generic_site` at ``tmp_path``: ``write_site("D", videos={"v1": 6})``."""
    return partial(write_generic_site, tmp_path)


TEST_DEVICE_ENV = "FEDST_TEST_DEVICE"
"""Environment variable naming the device of the tests that take the ``test_device`` fixture
(default cpu; ``bash bench/gpu_check/gpu_check.sh`` sets cuda on a GPU machine)."""


@pytest.fixture(scope="session")
def test_device():
    """The torch device named by $FEDST_TEST_DEVICE (default cpu). A device this machine lacks is
    an error, not a skip, so a GPU check cannot pass on the CPU by accident."""
    import torch

    device = torch.device(os.environ.get(TEST_DEVICE_ENV, "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"{TEST_DEVICE_ENV}={device} but CUDA is not available here; unset it")
    return device


@pytest.fixture(scope="module")
def single_torch_thread():
    """One intra-op thread for a test module (``pytestmark = pytest.mark.usefixtures(...)``): on a
    shared, loaded CPU spinning OpenMP threads make tiny ops slow."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="session")
def _validation_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory):
    """Keep the data-validation cache (fedst/data/validation.py) out of the user's ~/.cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv("FEDST_CACHE_DIR", str(tmp_path_factory.mktemp("fedst_cache")))
    yield
    patch.undo()


def reply_of_one_site(
    cfg, run_root: Path, message_type: str, arrays: dict | None = None, **config
) -> Message:
    """Send one message to site A's ClientApp as the in-process engine would (the site view of
    ``cfg``, run name "run", A's node config with its state under ``run_root/run/sites/A``) and
    return the reply; ``arrays`` are the tensors sent (default none, packed in fp32 as the server
    packs them), ``config`` adds e.g. ``server-round`` and ``local-iters``."""
    from flwr.app import ConfigRecord, RecordDict

    from fedst.app.client_app import app as client_app
    from fedst.app.client_app import release_sites
    from fedst.app.inprocess import InProcessGrid
    from fedst.app.nodes import site_node_config
    from fedst.experiment import site_view
    from fedst.federation import transport

    state_dir = run_root / "run" / "sites" / "A"
    node = site_node_config(cfg, "A", run_state_dir=str(state_dir)).to_node_config()
    grid = InProcessGrid(client_app, [node])
    content = {"experiment": site_view(cfg).to_json(), "run-name": "run", **config}
    message = Message(
        RecordDict(
            {
                **transport.pack(arrays or {}, "fp32").records("arrays"),
                "config": ConfigRecord(content),
            }
        ),
        dst_node_id=1,
        message_type=message_type,
        group_id=str(config.get("server-round", 0)),
    )
    try:
        (reply,) = grid.send_and_receive([message])
    finally:
        release_sites()
    return reply


def sent_keys(message: Message, record: str = "arrays") -> set[str]:
    """The tensor keys a message carries in ``record``, read from its manifest (checked against
    its buffers, fedst/federation/transport.py)."""
    from fedst.federation import transport

    return set(transport.received(message.content, record).shapes())


def train_reply(arrays: Mapping, num_examples: int = 1, **metrics: float) -> Message:
    """A constructed train reply of a site, as the server's strategies see it once the server
    has unpacked it: ``arrays`` (key -> torch tensor, one Array each) as gamma_k, the weight keys every reply carries ("num-examples" = ``num_examples``,
    "uniform-weight" = 1), a training loss and any further ``metrics``."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from fedst.app.client_app import app as client_app
    from fedst.app.inprocess import InProcessGrid

    content = RecordDict(
        {
            "arrays": ArrayRecord(dict(arrays)),
            "metrics": MetricRecord(
                {"num-examples": num_examples, "uniform-weight": 1, "train-loss": 0.5, **metrics}
            ),
            "site": ConfigRecord({"site": "X"}),
        }
    )
    InProcessGrid(client_app, [])  # sets Flower's task identity for building messages
    instruction = Message(RecordDict(), dst_node_id=1, message_type="train", group_id="1")
    instruction.metadata.__dict__["_message_id"] = "m"
    return Message(content, reply_to=instruction)


def site_record(site: str, instruction: Message, data_size: int | None = None):
    """The "site" record of a constructed reply to ``instruction``: the site's name, the round
    the instruction asked (its config's server-round) and, for a train reply, its data size."""
    from flwr.app import ConfigRecord

    from fedst.app import keys

    record = {
        keys.SITE_NAME: site,
        keys.SITE_ROUND: int(instruction.content[keys.CONFIG][keys.SERVER_ROUND]),
    }
    if data_size is not None:
        record[keys.DATA_SIZE] = data_size
    return ConfigRecord(record)


def stand_in_reply(instruction: Message, content: dict, metrics: dict) -> Message:
    """A stand-in site's reply to ``instruction`` from its records (``content``) and its own
    metrics: a train reply also reports a loss and time, an evaluate reply fixed scores."""
    from flwr.app import MessageType, MetricRecord, RecordDict

    if instruction.metadata.message_type == MessageType.TRAIN:
        metrics = {**metrics, "train-loss": 1.0, "seconds": 0.0}
    else:
        metrics = {**metrics, "dice": 0.5, "iou": 0.5, "hd95": 1.0, "assd": 1.0}
    return Message(RecordDict({**content, "metrics": MetricRecord(metrics)}), reply_to=instruction)


def strings_in_code(path: Path, values: set[str]) -> list[str]:
    """``file:line spells 'value'`` for each string constant of ``path`` (f-string parts
    included, docstrings not) that is one of ``values``: for the tests that keep a name spelled in
    one module only (tests/test_wire_keys.py, tests/test_run_layout.py)."""
    import ast

    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        f"{path.name}:{node.lineno} spells {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in values and id(node) not in docstrings
    ]


REPO = Path(__file__).resolve().parents[1]

FRESH_INTERPRETER_WARNING_FILTERS = [  # Python's defaults (no -W, no -X dev), first match wins
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""),
    ("ignore", ImportWarning, ""),
    ("ignore", ResourceWarning, ""),
]


def run_command(argv: Sequence[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``python <argv>`` in a process of its own from ``cwd`` (``train_fed.py`` /
    ``eval_outfed.py``: the repository's; ``-m fedst.x``: a module), with this repository on
    PYTHONPATH, FEDST_DEBUG and HYDRA_FULL_ERROR unset and ``env`` added."""
    argv = list(argv)
    if argv[0].endswith(".py"):
        argv = [str(REPO / argv[0]), *argv[1:]]
    base = {k: v for k, v in os.environ.items() if k not in ("FEDST_DEBUG", "HYDRA_FULL_ERROR")}
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env={
            **base,
            "PYTHONPATH": str(REPO),
            "FLWR_TELEMETRY_ENABLED": "0",
            "OMP_NUM_THREADS": "1",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_in_process(
    argv: Sequence[str], cwd: Path, capfd: pytest.CaptureFixture[str], **env: str
) -> subprocess.CompletedProcess:
    """:func:`run_command` in this process: the script (``train_fed.py``) or module (``-m
    fedst.x``) runs as ``__main__`` (runpy, as the interpreter runs it) and its exit status,
    stdout and stderr come back as from :func:`run_command`, with the warnings it raises (under
    a fresh interpreter's filters) printed on its stderr. The command starts with no logging
    handler and the root logger at WARNING, as in a new interpreter; afterwards the working
    directory, environment, ``sys.argv``, temp folder, logging, signal handlers, torch's
    determinism flags and thread count and fedst.cli's list of new run directories are as
    before. Much cheaper than a process of its own once the modules are imported."""
    from fedst.cli import NewRunDirectories

    argv = list(argv)
    module = argv[1] if argv[0] == "-m" else None
    arguments = argv[2:] if module else argv[1:]
    with _state_of_a_fresh_process(cwd, env), warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        for action, category, module_pattern in reversed(FRESH_INTERPRETER_WARNING_FILTERS):
            warnings.filterwarnings(action, category=category, module=module_pattern)
        warnings.filterwarnings(  # runpy's note on a module this session imported before
            "ignore",
            message=".* found in sys.modules after import of package",
            category=RuntimeWarning,
        )
        NewRunDirectories.created.clear()
        capfd.readouterr()
        try:
            if module:
                sys.argv = [module, *arguments]  # runpy sets argv[0] to the module's file
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [str(REPO / argv[0]), *arguments]
                runpy.run_path(str(REPO / argv[0]), run_name="__main__")
            status = 0
        except SystemExit as stopped:
            status = _exit_status(stopped.code)
        finally:
            NewRunDirectories.created.clear()
            out, err = capfd.readouterr()
        for warning in caught:
            err += warnings.formatwarning(
                warning.message, warning.category, warning.filename, warning.lineno, warning.line
            )
    return subprocess.CompletedProcess(argv, status, out, err)


@pytest.fixture
def in_process(capfd: pytest.CaptureFixture[str]) -> Callable[..., subprocess.CompletedProcess]:
    """:func:`run_in_process` with this test's captured output: ``in_process(argv, cwd, **env)``."""
    return partial(run_in_process, capfd=capfd)


def _exit_status(code: object) -> int:
    """The exit status of ``sys.exit(code)``: None 0, an int itself, anything else (printed) 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


@contextmanager
def _state_of_a_fresh_process(cwd: Path, env: Mapping[str, str]) -> Iterator[None]:
    """Run the body as a new interpreter would start it (cwd, env, no logging handler, root at
    WARNING) and put back afterwards what a command may change in process-wide state."""
    import torch

    environment, argv, directory = dict(os.environ), list(sys.argv), os.getcwd()
    temp_folder = tempfile.tempdir
    root = logging.getLogger()
    root_handlers, root_level, disabled = (
        list(root.handlers),
        root.level,
        logging.root.manager.disable,
    )
    loggers = {
        name: (list(logger.handlers), logger.level, logger.propagate, logger.disabled)
        for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    torch_state = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.get_num_threads(),
    )
    for name in ("FEDST_DEBUG", "HYDRA_FULL_ERROR"):
        os.environ.pop(name, None)
    os.environ.update(env)
    tempfile.tempdir = None  # read $TMPDIR again
    root.handlers = []
    root.setLevel(logging.WARNING)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(directory)
        os.environ.clear()
        os.environ.update(environment)
        sys.argv = argv
        tempfile.tempdir = temp_folder
        for handler in root.handlers:
            if handler not in root_handlers:
                handler.close()
        root.handlers = root_handlers
        root.setLevel(root_level)
        logging.disable(disabled)
        for name, logger in logging.Logger.manager.loggerDict.items():
            if not isinstance(logger, logging.Logger):
                continue
            kept = loggers.get(name, ([], logging.NOTSET, True, False))
            for handler in logger.handlers:
                if handler not in kept[0]:
                    handler.close()
            logger.handlers, logger.propagate, logger.disabled = list(kept[0]), kept[2], kept[3]
            logger.setLevel(kept[1])
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.use_deterministic_algorithms(torch_state[0], warn_only=torch_state[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = torch_state[2:4]
        torch.set_num_threads(torch_state[4])


# -- the tiny runs a session shares ----------------------------------------------------------------


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that reads a shared run must be in a file of :data:`SHARED_RUN_FILES` (else a
    second worker would train the run again)."""
    for item in items:
        reads = {"tiny_run", "tiny_cli_run"} & set(getattr(item, "fixturenames", ()))
        if reads and item.nodeid.split("::")[0] not in SHARED_RUN_FILES:
            raise pytest.UsageError(
                f"{item.nodeid} reads {sorted(reads)}: add its file to SHARED_RUN_FILES "
                "(tests/work_units.py)"
            )


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny procedural benchmark (seed 0), generated once per session: read it only (a test
    that changes it copies it first)."""
    from fedst.data.procedural import generate

    root = tmp_path_factory.mktemp("tiny_data") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


@pytest.fixture(scope="session")
def tiny_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """(config, run directory, final.json) of a finished tiny FedST run (``experiment=tiny``: 2
    rounds, SERQ on, the default train.keep_resume_state=false) trained in process, once per
    session, for the tests that only read a finished run: copy the directory before changing it
    (``shutil.copytree``)."""
    from fedst.cli import compose_experiment
    from fedst.training import run_training

    cfg = compose_experiment(["experiment=tiny", f"data.root={tiny_data}"])[0]
    run_dir = tmp_path_factory.mktemp("tiny_run") / "run"
    final = run_training(cfg, run_dir, progress=False)
    return cfg, run_dir, final


@dataclass(frozen=True)
class CliRun:
    """What :func:`tiny_cli_run` ran: its run directory, its stdout and stderr, and the system
    temp folder and cache folder it was given (both new)."""

    run_dir: Path
    stdout: str
    stderr: str
    temp: Path
    cache: Path


@pytest.fixture(scope="session")
def tiny_cli_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    """``train_fed.py experiment=tiny progress=true`` (FedST, 2 rounds, SERQ on) in a process of
    its own, once per session: stdout and stderr captured (not a terminal), TMPDIR an empty
    folder, XDG_CACHE_HOME a new one (FEDST_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR unset). For the
    tests that read a run made from the command line: copy ``run_dir`` before writing into it."""
    work = tmp_path_factory.mktemp("tiny_cli_run")
    temp, cache, run_dir = work / "temp", work / "cache", work / "run"
    temp.mkdir()
    removed = ("FEDST_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FEDST_DEBUG", "HYDRA_FULL_ERROR")
    env = {key: value for key, value in os.environ.items() if key not in removed}
    env.update(
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        FLWR_TELEMETRY_ENABLED="0",
        HF_HUB_OFFLINE="1",
        TMPDIR=str(temp),
        XDG_CACHE_HOME=str(cache),
    )
    command = [sys.executable, str(REPO / "train_fed.py"), "experiment=tiny"]
    command += [f"data.root={tiny_data}", f"hydra.run.dir={run_dir}", "progress=true"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return CliRun(run_dir, done.stdout, done.stderr, temp, cache)


def classifier_bias(shared: dict) -> str:
    """The bias of the classifier the current frame's logits come from: the decode head's
    (CFFM's ``linear_pred2``, the default placement) or the decoder's (encoder placement)."""
    head = "temporal.decode_head.classifier.bias"
    return head if head in shared else "decoder.head.bias"
