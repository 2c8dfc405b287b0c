"""Run a trained site model on a video, frame by frame: overlay video, label maps, timing log.

    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=case12.mp4
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=frames/ fps=25 labels=true
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=outfed prompt_site=E input=0   # camera 0
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=case12.mp4 guard=dad     # corrected
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=case12.mp4 runtime=onnx-int8 threads=2

Frames are read with OpenCV and streamed through the model (FedSTNet.stream in
fedst/model/network.py): each frame is encoded once, and the temporal module's earlier frames are
chosen by time as in training, clip.interval_s apart (the latest earlier frame at or before
t - k * interval_s; the current frame before the video's start; FrameHistory in
fedst/data/clips/). A frame's time is index / fps for a video file (its own frame rate, or
fps=) and a frame folder (fps= required), and the arrival time for a camera. Each frame is
resized to the run's clip.image_size and normalised as in training; the logits are resized back
to the frame's own size (bilinear) before the argmax, so overlays and label maps have the
input's resolution.

Writes into output= (default <run>/infer/<site>_<input name>/): overlay.mp4 (shaft / wrist / jaw
in the colours of fedst/report/plots.py, with a legend), timing.csv (per frame: read, network, write and
total ms), labels/<frame>.png (uint8 class maps 0..3, with labels=true) and summary.json (with
guard=dad: which DAD correction ran; "network": the runtime that ran, e.g. onnx-int8, and its
graph file). runtime=onnx / onnx-int8 runs the graph exported by fedst/export.py (format=onnx
/ onnx-int8) in ONNX Runtime on the CPU instead of PyTorch. Each file is written under a
temporary name and renamed when the run is complete, so a failed run leaves the folder as it
was. A progress bar shows the running FPS. Bad input (a file that is not a video, a frame-size change, a missing key) stops
with one line naming the file or key and the fix.
"""

from __future__ import annotations

import ast
import codecs
import csv
import dataclasses
import inspect
import itertools
import json
import logging
import os
import shutil
import sys
import textwrap
import time
import typing
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from fedst.accel import resolve_device
from fedst.config import build, did_you_mean
from fedst.data.clips import normalize_frames, resize_frame
from fedst.errors import UserError
from fedst.experiment import ExperimentConfig
from fedst.model.network import FedSTNet
from fedst.progress import progress_bar
from fedst.report.plots import PART_COLORS, overlay_masks
from fedst.runs import Run
from fedst.storage import require_output_folder

__all__ = [
    "InferConfig",
    "InferenceError",
    "StagedOutputs",
    "VideoInput",
    "dad_correction",
    "draw_legend",
    "key_value_help",
    "load_site_model",
    "main",
    "open_input",
    "parse_key_values",
    "run_inference",
]

log = logging.getLogger("fedst.infer")

OUTFED = "outfed"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
VIDEO_FOURCC = "mp4v"
OVERLAY, TIMING, SUMMARY, LABELS = "overlay.mp4", "timing.csv", "summary.json", "labels"
TIMING_COLUMNS = ("frame", "time_s", "read_ms", "network_ms", "write_ms", "total_ms")
TEXT_SNIFF_BYTES = 4096
TEXT_CONTROLS = "\t\n\r\f\b\x1b"
"""Control characters a text file may hold (\\x1b: ANSI colour escapes); any other marks binary."""
TEXT_CODECS = ("ansi",)
"""Codecs of FFmpeg's text renderers: its "tty" demuxer opens a .txt / .nfo / .ans file and draws
its characters as 640x400 frames (codec "ansi")."""
TEXT_ART_SUFFIXES = (".bin", ".adf", ".idf", ".xb")
"""Extensions FFmpeg's "bintext" demuxer claims: it may draw such a file as ANSI art, with a codec
OpenCV has no four-character code for (refused only then: a video with one of these extensions
still has its codec's code)."""


class InferenceError(UserError, ValueError):
    """Bad input for inference or export: the message names the file or key and the fix."""


@dataclass(frozen=True)
class InferConfig:
    run: str
    """Run directory written by train_fed.py (holds config.json, checkpoints/, sites/)."""
    site: str
    """A federated site of the run (its personalized model) or "outfed" (the averaged model)."""
    input: str
    """A video file, a folder of frame images (sorted by name), or a camera index (0, 1, ...)."""
    output: str | None = None
    """Output folder (default <run>/infer/<site>_<input name>)."""
    prompt_site: str | None = None
    """site=outfed: the site whose indicator prompts the model (e.g. E); any configured site."""
    fps: float | None = None
    """Frame rate of a frame folder (required there); overrides a video's or camera's own."""
    labels: bool = False
    """Also write each frame's label map as labels/<frame>.png (uint8, 0 background .. 3 jaw)."""
    alpha: float = 0.5
    """Opacity of the class colours in the overlay."""
    max_frames: int | None = None
    """Stop after this many frames (a camera runs until then or Ctrl-C)."""
    device: str = "auto"
    """auto (CUDA when present, else CPU) | cpu | cuda | cuda:N."""
    progress: bool = True
    """Show a progress bar with the running FPS."""
    runtime: str = "torch"
    """torch (PyTorch on device=) | onnx | onnx-int8 (the graph exported by fedst/export.py with
    format=onnx / onnx-int8, run by ONNX Runtime on the CPU); summary.json records it."""
    onnx_file: str | None = None
    """runtime=onnx / onnx-int8: the exported graph (default <run>/export/<site>.onnx or
    <site>.int8.onnx; site=outfed: outfed_<prompt_site>)."""
    threads: int | None = None
    """CPU threads of the network (PyTorch or ONNX Runtime intra-op); default: the library's."""
    guard: str | None = None
    """dad: the model corrected by GEN-Guard's DAD (fedst/guard/, python -m fedst.guard) instead
    of the last round's: the site's corrected v_k, or for site=outfed the out-of-federation model
    corrected at the held-out site. Its sites/<site>/guard/dad.pt must exist; summary.json names
    it."""


# -- command line ------------------------------------------------------------------------------

C = TypeVar("C")


def parse_key_values(
    cls: type[C], argv: Sequence[str], doc: str | None = None, prog: str | None = None
) -> C:
    """``key=value`` arguments -> config dataclass ``cls`` (unknown or missing keys are errors).

    Values are read as YAML scalars (``labels=true``, ``fps=25``, ``size=[512,640]``); a field
    typed ``str`` keeps its text (``input=0`` is camera "0"). ``-h`` / ``--help`` prints
    :func:`key_value_help` and exits 0.
    """
    from omegaconf import OmegaConf

    if any(arg in ("-h", "--help") for arg in argv):
        print(key_value_help(cls, doc, prog))
        sys.exit(0)
    bad = [arg for arg in argv if "=" not in arg]
    if bad:
        raise InferenceError(f"arguments are key=value; got {bad}")
    values = OmegaConf.to_container(OmegaConf.from_dotlist(list(argv)))
    hints = typing.get_type_hints(cls)
    for name, value in list(values.items()):
        if hints.get(name) is str or (hints.get(name) == str | None and value is not None):
            values[name] = str(value)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in values if key not in known]
    if unknown:  # before the missing ones: a misspelled required key is both (inptu=)
        raise InferenceError(
            f"{unknown[0]}={values[unknown[0]]}: unknown key{did_you_mean(unknown[0], known)}; "
            f"keys: {', '.join(known)} (see --help)"
        )
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.name not in values
    ]
    if missing:
        raise InferenceError(f"missing required key(s) {missing}; see --help")
    return build(cls, values, cls.__name__)


def key_value_help(cls: type, doc: str | None, prog: str | None, width: int = 100) -> str:
    """Terminal help of a key=value command: a usage line, ``doc`` as written (plain text,
    pre-formatted), then every field of ``cls`` with its default as typed on the command line
    (null, true, [512, 640]) and its docstring re-wrapped."""
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    usage = " ".join([prog or cls.__name__, *(f"{n}={n.upper()}" for n in required)])
    docs = _field_docs(cls)
    keys = []
    for f in dataclasses.fields(cls):
        value = "(required)" if f.name in required else _as_typed(f.default)
        keys.append(f"  {f.name}={value}")
        text = " ".join(docs.get(f.name, "").split())
        keys.append(textwrap.fill(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(
        [
            f"usage: {usage} [key=value ...]",
            "",
            (doc or "").strip(),
            "",
            "keys (values are YAML: true, 25, null, [512,640]):",
            *keys,
        ]
    )


def _as_typed(value: Any) -> str:
    """A default as it would be typed on the command line (YAML)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple | list):
        return f"[{','.join(_as_typed(v) for v in value)}]"
    return str(value)


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        node.target.id: after.value.value
        for node, after in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }


# -- the model -----------------------------------------------------------------------------------


def load_site_model(
    run_dir: Path,
    site: str,
    prompt_site: str | None,
    device: torch.device,
    guard: str | None = None,
) -> tuple[ExperimentConfig, FedSTNet, torch.Tensor | None]:
    """(run config, model in eval mode on ``device``, its indicator or None) of a finished run.

    ``site``: a federated site -> v_k = gamma_g U rho_k; "outfed" -> the out-of-federation model
    (fedst/runs/outfed.py), prompted with ``prompt_site``'s indicator. ``guard="dad"``: the model
    corrected by DAD at that site (the held-out site for "outfed"; fedst/guard/).
    """
    if not run_dir.is_dir():
        raise InferenceError(f"run directory {run_dir} does not exist")
    if guard not in (None, "dad"):
        raise InferenceError(f"guard={guard!r}: choose dad (GEN-Guard's correction) or null")
    run = Run(run_dir)
    cfg = run.cfg
    federation = list(cfg.data.federation)
    if site == OUTFED:
        if cfg.uses_indicator() and prompt_site is None:
            raise InferenceError(
                f"site=outfed is prompted with the target site's own indicator: add "
                f"prompt_site=<one of {sorted(cfg.data.sites)}>"
            )
        if prompt_site is not None and prompt_site not in cfg.data.sites:
            raise InferenceError(
                f"prompt_site={prompt_site!r} is not a site of run {run_dir}; its sites are "
                f"{sorted(cfg.data.sites)}"
            )
        indicator_site = prompt_site
    elif site in federation:
        indicator_site = site
    else:
        raise InferenceError(
            f"run {run_dir} has no site {site!r}: its federated sites are {federation} "
            f"(or site=outfed prompt_site=<site>)"
        )
    model = _trained_model(run, site, device, guard)
    indicator = run.method.indicators().get(indicator_site) if indicator_site else None
    if indicator is not None:
        indicator = indicator.to(device)
    return cfg, model.eval(), indicator


def _trained_model(run: Run, site: str, device: torch.device, guard: str | None) -> torch.nn.Module:
    """The model of ``site`` (a federated site: its training party's; or "outfed") after the
    run's last round, or with ``guard="dad"`` the DAD-corrected one (logged with its file)."""
    from fedst.guard import GuardError, load_guarded_model

    if guard is None:
        if site == OUTFED:
            return run.outfed_model(device)
        return run.site_model(run.method.party_of(site), device)
    owner, correction = dad_correction(run, site)
    try:
        model = load_guarded_model(run, owner, device)
    except GuardError as err:
        raise InferenceError(str(err)) from err
    log.info(
        "guard=dad: the %s model corrected by GEN-Guard's DAD at site %s, from %s",
        site,
        owner,
        correction,
    )
    return model


def dad_correction(run: Run, site: str) -> tuple[str, Path]:
    """(owner, file) of the DAD correction that ``guard=dad`` applies to ``site``'s model: the
    correction of the site's training party, or for "outfed" the held-out site's, saved as
    ``<owner's site state dir>/guard/dad.pt`` (fedst/guard/)."""
    from fedst.guard import GuardError, guard_file, held_out_site

    try:
        owner = held_out_site(run.cfg) if site == OUTFED else run.method.party_of(site)
    except GuardError as err:
        raise InferenceError(str(err)) from err
    return owner, guard_file(run.dir, owner)


# -- the input -----------------------------------------------------------------------------------


@dataclass
class VideoInput:
    """Frames of a video file, frame folder or camera: ``frames()`` yields (time_s, RGB uint8)."""

    name: str
    fps: float
    num_frames: int | None
    _read: Callable[[], Iterator[tuple[float, np.ndarray]]]
    _close: Callable[[], None] | None = None

    def frames(self) -> Iterator[tuple[float, np.ndarray]]:
        yield from self._read()

    def close(self) -> None:
        if self._close is not None:
            self._close()


def open_input(spec: str, fps: float | None = None) -> VideoInput:
    """Open ``spec`` (video file, frame folder or camera index) or raise one clear InferenceError.

    A text file is refused before OpenCV opens it (:func:`_looks_like_text`), and a file FFmpeg
    opens as text or ANSI art after (TEXT_CODECS, TEXT_ART_SUFFIXES): FFmpeg would draw its
    characters as frames."""
    if fps is not None and fps <= 0:
        raise InferenceError(f"fps={fps} must be a positive number of frames per second")
    if spec.isdigit():
        return _open_camera(int(spec), fps)
    path = Path(spec)
    if not path.exists():
        raise InferenceError(f"input {path} does not exist (give a video file, folder or camera)")
    if path.is_dir():
        return _open_folder(path, fps)
    if path.stat().st_size == 0:
        raise InferenceError(f"input {path} is an empty file (0 bytes): nothing to read")
    if _looks_like_text(path):
        raise InferenceError(
            f"input {path} is a text file, not a video: cannot decode frames from it; give a "
            f"video file (.mp4, .avi, ...), a folder of frame images (with fps=) or a camera index"
        )
    capture = cv2.VideoCapture(str(path))
    ok, first = capture.read() if capture.isOpened() else (False, None)
    if not ok:
        capture.release()
        raise InferenceError(
            f"OpenCV cannot decode a frame of {path}: not a video or an unsupported codec; "
            f"re-encode it (ffmpeg -i {path.name} -c:v libx264 out.mp4) or pass a frame folder"
        )
    codec = _fourcc(capture)
    if codec.lower() in TEXT_CODECS or (not codec and path.suffix.lower() in TEXT_ART_SUFFIXES):
        capture.release()
        raise InferenceError(
            f"input {path} is a text or ANSI-art file, not a video (FFmpeg draws its characters "
            f"as frames, codec {codec or 'bintext'!r}); give a video file (.mp4, .avi, ...), a "
            f"folder of frame images (with fps=) or a camera index"
        )
    rate = fps or capture.get(cv2.CAP_PROP_FPS)
    if not rate or not np.isfinite(rate) or rate <= 0:
        capture.release()
        raise InferenceError(f"{path} reports no frame rate; pass fps=<frames per second>")
    count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))

    def read() -> Iterator[tuple[float, np.ndarray]]:
        frame, index = first, 0
        while frame is not None:
            yield index / rate, cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
            ok, frame = capture.read()
            frame, index = (frame if ok else None), index + 1

    return VideoInput(str(path), float(rate), count if count > 0 else None, read, capture.release)


def _looks_like_text(path: Path) -> bool:
    """Whether the file's first TEXT_SNIFF_BYTES bytes are UTF-8 text (printable characters,
    whitespace and ANSI escapes). No video container or image format starts like that: MP4, AVI,
    MPEG-TS, PNG and BMP have NUL bytes in their first header, Matroska / WebM and JPEG bytes
    that are not text."""
    with path.open("rb") as handle:
        head = handle.read(TEXT_SNIFF_BYTES)
    try:  # not final: a multi-byte character cut at the end of the sample is not an error
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return not any((ord(c) < 0x20 and c not in TEXT_CONTROLS) or c == "\x7f" for c in text)


def _fourcc(capture: cv2.VideoCapture) -> str:
    """The codec's four-character code as OpenCV reports it ("" when it reports none)."""
    code = int(capture.get(cv2.CAP_PROP_FOURCC))
    return "".join(chr((code >> shift) & 0xFF) for shift in (0, 8, 16, 24)).strip("\x00")


def _open_folder(path: Path, fps: float | None) -> VideoInput:
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise InferenceError(f"folder {path} holds no frame images ({', '.join(IMAGE_SUFFIXES)})")
    if fps is None:
        raise InferenceError(
            f"{path} is a folder of frames, which has no frame rate: pass fps=<frames per second>"
        )

    def read() -> Iterator[tuple[float, np.ndarray]]:
        for index, file in enumerate(files):
            bgr = cv2.imread(str(file), cv2.IMREAD_COLOR)
            if bgr is None:
                raise InferenceError(f"cannot read image {file} (corrupt or not an image)")
            yield index / fps, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)

    return VideoInput(str(path), float(fps), len(files), read)


def _open_camera(index: int, fps: float | None) -> VideoInput:
    capture = cv2.VideoCapture(index)
    if not capture.isOpened():
        raise InferenceError(f"cannot open camera {index} with OpenCV (is it connected and free?)")
    rate = fps or capture.get(cv2.CAP_PROP_FPS)
    if not rate or rate <= 0:
        capture.release()
        raise InferenceError(f"camera {index} reports no frame rate; pass fps=<frames per second>")

    def read() -> Iterator[tuple[float, np.ndarray]]:
        start = None
        while True:
            ok, frame = capture.read()
            if not ok:
                return
            now = time.monotonic()
            start = now if start is None else start
            yield now - start, cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)  # arrival time

    return VideoInput(f"camera{index}", float(rate), None, read, capture.release)


# -- the overlay ---------------------------------------------------------------------------------


def draw_legend(image_rgb: np.ndarray, palette=PART_COLORS) -> np.ndarray:
    """Class colour swatches and names in the top-left corner of an RGB uint8 image (in place)."""
    height = image_rgb.shape[0]
    scale = max(0.3, height / 720 * 0.6)
    thickness = max(1, round(scale * 1.5))
    line = max(8, round(26 * scale / 0.6))
    swatch = max(4, round(line * 0.6))
    width = max(
        cv2.getTextSize(n, cv2.FONT_HERSHEY_SIMPLEX, scale, thickness)[0][0]
        for n, _ in palette.values()
    )
    panel_w, panel_h = swatch + width + line // 2 + 8, line * len(palette) + 6
    panel = image_rgb[:panel_h, :panel_w]
    panel[:] = (panel.astype(np.float32) * 0.4).astype(np.uint8)  # darken behind the legend
    for row, (name, color) in enumerate(palette.values()):
        top = 4 + row * line
        cv2.rectangle(image_rgb, (4, top), (4 + swatch, top + swatch), color, thickness=-1)
        cv2.putText(
            image_rgb,
            name,
            (8 + swatch, top + swatch),
            cv2.FONT_HERSHEY_SIMPLEX,
            scale,
            (255, 255, 255),
            thickness,
            cv2.LINE_AA,
        )
    return image_rgb


# -- the loop ------------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_inference(cfg: InferConfig) -> dict[str, Any]:
    """Stream ``cfg.input`` through the site model and write the outputs; return the summary.

    The outputs appear together, once complete (:class:`StagedOutputs`): an error part-way
    leaves the output folder as it was; Ctrl-C keeps the frames so far."""
    run_dir = Path(cfg.run)
    if cfg.output:  # before any model or video is read
        require_output_folder(Path(cfg.output), "output")
    if cfg.runtime != "torch":
        _check_onnx_request(cfg, run_dir)
    device = (
        resolve_device(cfg.device, key="device") if cfg.runtime == "torch" else torch.device("cpu")
    )
    if cfg.threads is not None and cfg.runtime == "torch":
        torch.set_num_threads(cfg.threads)
    source = open_input(cfg.input, cfg.fps)
    try:
        if cfg.runtime == "torch":
            experiment, model, indicator = load_site_model(
                run_dir, cfg.site, cfg.prompt_site, device, cfg.guard
            )
        else:
            stream, network = _onnx_network(cfg, run_dir)
    except BaseException:
        source.close()
        raise
    guard = None
    if cfg.guard is not None:
        owner, correction = dad_correction(Run(run_dir, experiment), cfg.site)
        guard = {"name": cfg.guard, "corrected_at": owner, "correction": str(correction)}
    default_dir = run_dir / "infer" / f"{cfg.site}_{Path(source.name).stem}"
    out_dir = Path(cfg.output) if cfg.output else default_dir
    if cfg.runtime == "torch":
        image_size = tuple(experiment.clip.image_size)
        interval_s = experiment.clip.interval_s
        temporal = model.uses_temporal(experiment.clip_config().num_frames)
        stream = model.stream(indicator, interval_s=interval_s, use_temporal=temporal)
        network = {"runtime": "torch", "device": str(device), "threads": torch.get_num_threads()}
    else:
        image_size, interval_s = tuple(stream.meta["image_size"]), stream.meta["interval_s"]
        temporal = bool(stream.streamer.stages)
    log.info(
        "%s: %s model of %s%s on %s (%s fps), network input %dx%d, clip frames %.2f s apart (%s)",
        source.name,
        cfg.site,
        run_dir,
        " corrected by DAD" if guard else "",
        device if cfg.runtime == "torch" else f"ONNX Runtime ({network['runtime']}, CPU)",
        f"{source.fps:g}",
        *image_size,
        interval_s,
        "temporal" if temporal else "single frame",
    )
    writer, frame_size, rows = None, None, []
    known = [n for n in (source.num_frames, cfg.max_frames) if n is not None]
    bar = progress_bar(
        total=min(known, default=None), unit="frame", desc="infer", enabled=cfg.progress
    )
    started = time.perf_counter()
    frames = source.frames()
    with StagedOutputs(out_dir, labels=cfg.labels) as outputs:
        try:
            index = 0
            while cfg.max_frames is None or index < cfg.max_frames:
                t0 = time.perf_counter()
                item = next(frames, None)
                if item is None:
                    break
                time_s, rgb = item
                if frame_size is None:
                    frame_size = rgb.shape[:2]
                    writer = _open_writer(outputs.file(OVERLAY), source.fps, frame_size)
                elif rgb.shape[:2] != frame_size:
                    raise InferenceError(
                        f"frame {index} of {source.name} is {rgb.shape[1]}x{rgb.shape[0]} but "
                        f"the stream started at {frame_size[1]}x{frame_size[0]}: split or resize "
                        f"the input so every frame has one size"
                    )
                t1 = time.perf_counter()
                frame = normalize_frames(resize_frame(rgb, image_size)[None]).to(device)
                logits = stream.step(frame, time_s)  # [1, K, H, W]
                logits = F.interpolate(
                    logits, size=frame_size, mode="bilinear", align_corners=False
                )  # [1, K, H0, W0]
                label = logits[0].argmax(0).to(torch.uint8).cpu().numpy()  # [H0, W0]
                _synchronize(device)
                t2 = time.perf_counter()
                overlay = draw_legend(overlay_masks(rgb, label, cfg.alpha))
                writer.write(cv2.cvtColor(overlay, cv2.COLOR_RGB2BGR))
                if outputs.labels is not None:
                    cv2.imwrite(str(outputs.labels / f"{index:09d}.png"), label)
                t3 = time.perf_counter()
                rows.append((index, time_s, t1 - t0, t2 - t1, t3 - t2, t3 - t0))
                index += 1
                bar.update()
                bar.set_postfix(fps=f"{index / (time.perf_counter() - started):.2f}", refresh=False)
        except KeyboardInterrupt:
            log.info("interrupted after %d frames; closing the outputs", len(rows))
        finally:
            bar.close()
            source.close()
            if writer is not None:
                writer.release()
        if not rows:
            raise InferenceError(f"no frame could be read from {source.name}")
        summary = _write_summary(cfg, source, outputs, rows, frame_size, started, guard, network)
    return summary


RUNTIMES = ("torch", "onnx", "onnx-int8")


def _check_onnx_request(cfg: InferConfig, run_dir: Path) -> None:
    """Refuse, before anything is opened, what an exported graph cannot do."""
    if cfg.runtime not in RUNTIMES:
        raise InferenceError(f"runtime={cfg.runtime!r} is not supported; choose one of {RUNTIMES}")
    if cfg.guard is not None:
        raise InferenceError(
            f"guard={cfg.guard} needs runtime=torch: the exported graph (runtime={cfg.runtime}) "
            f"is the last round's model, not the DAD-corrected one"
        )
    if cfg.device not in ("auto", "cpu"):
        raise InferenceError(
            f"runtime={cfg.runtime} runs on the CPU (ONNX Runtime's CPU provider); device="
            f"{cfg.device} applies to runtime=torch: drop device= or use runtime=torch"
        )
    if not run_dir.is_dir():
        raise InferenceError(f"run directory {run_dir} does not exist")


class _OnnxStream:
    """An exported step (fedst.export.OnnxStreamer) behind the PyTorch stream's interface:
    ``step(frame [1, 3, H, W] float tensor, time_s) -> logits [1, K, H, W] tensor``."""

    def __init__(self, streamer: Any) -> None:
        self.streamer = streamer
        self.meta = streamer.meta

    def step(self, frame: torch.Tensor, time_s: float) -> torch.Tensor:
        return torch.from_numpy(self.streamer.step(frame.numpy(), time_s))


def _onnx_network(cfg: InferConfig, run_dir: Path) -> tuple[_OnnxStream, dict[str, Any]]:
    """The exported graph of ``cfg.site`` in ONNX Runtime and its summary entry; refuses a graph
    of another site or prompt, and one whose kind (fp32 / int8) is not ``cfg.runtime``."""
    from fedst.onnx_stream import OnnxStreamer, default_export_path, export_command

    path = (
        Path(cfg.onnx_file)
        if cfg.onnx_file
        else default_export_path(run_dir, cfg.site, cfg.prompt_site, cfg.runtime)
    )
    if not path.is_file() or not path.with_suffix(".json").is_file():
        raise InferenceError(
            f"runtime={cfg.runtime}: no exported graph {path} (with its .json); export it with "
            f"{export_command(cfg.run, cfg.site, cfg.prompt_site, cfg.runtime)} or give "
            f"onnx_file="
        )
    streamer = OnnxStreamer(path, threads=cfg.threads)
    exported = streamer.meta.get("source") or {}
    if exported and (exported.get("site"), exported.get("prompt_site")) != (
        cfg.site,
        cfg.prompt_site,
    ):
        raise InferenceError(
            f"{path} is the graph of site={exported.get('site')} prompt_site="
            f"{exported.get('prompt_site')}, not of site={cfg.site} prompt_site={cfg.prompt_site}"
            f": give the matching onnx_file= or export this site"
        )
    if streamer.runtime != cfg.runtime:
        raise InferenceError(
            f"{path} holds the {streamer.runtime} graph but runtime={cfg.runtime}: set "
            f"runtime={streamer.runtime} or give the {cfg.runtime} graph as onnx_file="
        )
    if not exported:
        log.warning("%s records no site (exported before sidecars named it)", path)
    network = {
        "runtime": streamer.runtime,
        "device": "cpu",
        "threads": cfg.threads,
        "onnx_file": str(path),
        "providers": streamer.session.get_providers(),
    }
    return _OnnxStream(streamer), network


class StagedOutputs:
    """The output files of one inference run, written in ``out_dir`` under temporary names
    (``.overlay.<random>.tmp.mp4``, ``.labels.<random>.tmp/``) and renamed to their own names
    when the ``with`` block ends without an error: the label maps first, then the files in the
    order they were asked for (summary.json last). On an error they are deleted, with the
    folders this run created if they stayed empty, so a failed run leaves the folder as it was
    and never mixes its files with an earlier run's."""

    def __init__(self, out_dir: Path, labels: bool = False):
        self.out_dir = out_dir
        self.labels: Path | None = None
        """The temporary folder of the label maps (labels=true), inside the ``with`` block."""
        self._want_labels = labels
        self._created = [p for p in (out_dir, *out_dir.parents) if not p.exists()]  # deepest first
        self._files: dict[str, Path] = {}  # own name -> temporary path

    def __enter__(self) -> StagedOutputs:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self._want_labels:
            self.labels = self._temporary(LABELS)
            self.labels.mkdir()
        return self

    def file(self, name: str) -> Path:
        """Where to write the output ``name`` (a temporary path with the same suffix: OpenCV
        picks the container by it); it becomes ``out_dir / name`` at the end."""
        self._files[name] = self._temporary(name)
        return self._files[name]

    def _temporary(self, name: str) -> Path:
        stem, suffix = Path(name).stem, Path(name).suffix
        return self.out_dir / f".{stem}.{uuid.uuid4().hex[:12]}.tmp{suffix}"

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self._commit()
        else:
            self._discard()

    def _commit(self) -> None:
        if self.labels is not None:
            final, old = self.out_dir / LABELS, self._temporary(f"{LABELS}.old")
            if final.exists():  # an earlier run's label maps: replaced, not mixed with these
                os.replace(final, old)
            os.replace(self.labels, final)
            shutil.rmtree(old, ignore_errors=True)
        for name, tmp in self._files.items():
            os.replace(tmp, self.out_dir / name)

    def _discard(self) -> None:
        for tmp in self._files.values():
            tmp.unlink(missing_ok=True)
        if self.labels is not None:
            shutil.rmtree(self.labels, ignore_errors=True)
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:  # not empty: other files are there too
                break


def _open_writer(path: Path, fps: float, frame_size: tuple[int, int]) -> cv2.VideoWriter:
    height, width = frame_size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*VIDEO_FOURCC), fps, (width, height))
    if not writer.isOpened():
        raise InferenceError(
            f"OpenCV cannot write {path.parent / OVERLAY} ({VIDEO_FOURCC}, {width}x{height}); "
            f"check that the folder is writable and OpenCV has FFmpeg (cv2.getBuildInformation())"
        )
    return writer


def _write_summary(
    cfg: InferConfig,
    source: VideoInput,
    outputs: StagedOutputs,
    rows: list[tuple],
    frame_size: tuple[int, int],
    started: float,
    guard: dict[str, str] | None,
    network: dict[str, Any],
) -> dict[str, Any]:
    """Write timing.csv and summary.json (staged in ``outputs``) and return the summary."""
    with open(outputs.file(TIMING), "w", newline="") as handle:
        table = csv.writer(handle)
        table.writerow(TIMING_COLUMNS)
        for index, time_s, *seconds in rows:
            table.writerow([index, f"{time_s:.4f}", *(f"{s * 1e3:.2f}" for s in seconds)])
    network_s = np.array([r[3] for r in rows])
    out_dir = outputs.out_dir
    summary = {
        "input": source.name,
        "site": cfg.site,
        "guard": guard,
        "network": network,
        "frames": len(rows),
        "frame_size": list(frame_size),
        "fps_input": source.fps,
        "fps_overall": len(rows) / (time.perf_counter() - started),
        "fps_network_mean": float(1 / network_s.mean()),
        "network_ms_median": float(np.median(network_s) * 1e3),
        "overlay": str(out_dir / OVERLAY),
        "labels": str(out_dir / LABELS) if cfg.labels else None,
        "timing": str(out_dir / TIMING),
    }
    outputs.file(SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = parse_key_values(
            InferConfig, sys.argv[1:] if argv is None else argv, __doc__, "python -m fedst.infer"
        )
        summary = run_inference(cfg)
    except FileNotFoundError as err:  # a path the user gave: one line through the boundary
        raise InferenceError(str(err)) from err
    print(
        f"{summary['frames']} frames {summary['frame_size'][1]}x{summary['frame_size'][0]}: "
        f"{summary['fps_overall']:.2f} FPS overall, network {summary['fps_network_mean']:.2f} FPS; "
        f"wrote {summary['overlay']}"
    )


if __name__ == "__main__":
    from fedst.errors import run_entry_point

    run_entry_point(main, "python -m fedst.infer")
