"""Run a trained site model on a video, frame by frame: overlay video, label maps, timing log.

    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=case12.mp4
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=frames/ fps=25 labels=true
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=outfed prompt_site=E input=0   # camera 0
    python -m fedst.infer run=runs/demo/fedst_s0_8rounds site=A input=case12.mp4 guard=dad     # corrected

Frames are read with OpenCV and streamed through :meth:`fedst.model.network.FedSTNet.stream`: each
frame is encoded once and the temporal module's earlier frames are chosen by time, as in training
(``clip.interval_s`` apart: the latest earlier frame at or before ``t - k * interval_s``, the
current frame before the video's start; :class:`fedst.data.clips.FrameHistory`). A frame's time is
``index / fps`` for a video file (its own frame rate, or ``fps=``) and a frame folder (``fps=``
required), and the arrival time for a camera. Each frame is resized to the run's
``clip.image_size`` and normalised as in training; the logits are resized back to the frame's own
size (bilinear) before the argmax, so overlays and label maps have the input's resolution.

Writes into ``output`` (default ``<run>/infer/<site>_<input name>/``):
``overlay.mp4`` (shaft / wrist / jaw in the colours of fedst.plots, with a legend),
``timing.csv`` (per frame: read, network, write and total ms), ``labels/<frame>.png`` (uint8 class
maps 0..3, with ``labels=true``) and ``summary.json``. A progress bar shows the running FPS.
Bad input stops with one line naming the file and the fix.
"""

from __future__ import annotations

import ast
import csv
import dataclasses
import inspect
import itertools
import json
import logging
import sys
import textwrap
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from fedst.config import ConfigError, build
from fedst.data.clips import normalize_frames, resize_frame
from fedst.errors import UserError
from fedst.experiment import ExperimentConfig, resolve_device
from fedst.federation.run_io import load_config
from fedst.methods import method_of
from fedst.model.network import FedSTNet
from fedst.plots import PART_COLORS, overlay_masks
from fedst.progress import progress_bar

__all__ = [
    "InferConfig",
    "InferenceError",
    "VideoInput",
    "draw_legend",
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
TIMING_COLUMNS = ("frame", "time_s", "read_ms", "network_ms", "write_ms", "total_ms")


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
    guard: str | None = None
    """"dad": the model corrected by GEN-Guard's DAD (fedst/guard/, ``python -m fedst.guard``)
    instead of the last round's: the site's corrected v_k, or for site=outfed the out-of-federation
    model corrected at the held-out site. Its sites/<site>/guard/dad.pt must exist."""


# -- command line ------------------------------------------------------------------------------

C = TypeVar("C")


def parse_key_values(cls: type[C], argv: Sequence[str], doc: str | None = None) -> C:
    """``key=value`` arguments -> config dataclass ``cls`` (unknown or missing keys are errors).

    Values are read as YAML scalars (``labels=true``, ``fps=25``, ``size=[512,640]``); a field
    typed ``str`` keeps its text (``input=0`` is camera "0").
    """
    from omegaconf import OmegaConf

    if any(arg in ("-h", "--help") for arg in argv):
        docs = _field_docs(cls)
        fields = "\n".join(
            f"  {f.name}={'<required>' if f.default is dataclasses.MISSING else f.default}\n"
            f"      {docs.get(f.name, '')}"
            for f in dataclasses.fields(cls)
        )
        print(f"{doc or ''}\nkeys:\n{fields}")
        sys.exit(0)
    bad = [arg for arg in argv if "=" not in arg]
    if bad:
        raise InferenceError(f"arguments are key=value; got {bad}")
    values = OmegaConf.to_container(OmegaConf.from_dotlist(list(argv)))
    hints = typing.get_type_hints(cls)
    for name, value in list(values.items()):
        if hints.get(name) is str or (hints.get(name) == str | None and value is not None):
            values[name] = str(value)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.name not in values
    ]
    if missing:
        raise InferenceError(f"missing required key(s) {missing}; see --help")
    return build(cls, values, cls.__name__)


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
    (fedst/outfed.py), prompted with ``prompt_site``'s indicator. ``guard="dad"``: the model
    corrected by DAD at that site (the held-out site for "outfed"; fedst/guard/).
    """
    if not run_dir.is_dir():
        raise InferenceError(f"run directory {run_dir} does not exist")
    if guard not in (None, "dad"):
        raise InferenceError(f"guard={guard!r}: choose dad (GEN-Guard's correction) or null")
    cfg = load_config(run_dir)
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
        model = _trained_model(cfg, run_dir, OUTFED, device, guard)
        indicator_site = prompt_site
    elif site in federation:
        model = _trained_model(cfg, run_dir, method_of(cfg).party_of(site), device, guard)
        indicator_site = site
    else:
        raise InferenceError(
            f"run {run_dir} has no site {site!r}: its federated sites are {federation} "
            f"(or site=outfed prompt_site=<site>)"
        )
    indicator = method_of(cfg).indicators().get(indicator_site) if indicator_site else None
    if indicator is not None:
        indicator = indicator.to(device)
    return cfg, model.eval(), indicator


def _trained_model(
    cfg: ExperimentConfig, run_dir: Path, party: str, device: torch.device, guard: str | None
) -> torch.nn.Module:
    """The model of ``party`` (a training party, or "outfed") after the run's last round, or
    with ``guard="dad"`` the DAD-corrected one (the held-out site's correction for "outfed")."""
    from fedst.guard import GuardError, held_out_site, load_guarded_model
    from fedst.outfed import averaged_model, personalized_model

    if guard is None:
        if party == OUTFED:
            return averaged_model(cfg, run_dir, device)
        return personalized_model(cfg, run_dir, party, device)
    try:
        owner = held_out_site(cfg) if party == OUTFED else party
        return load_guarded_model(cfg, run_dir, owner, device)
    except GuardError as err:
        raise InferenceError(str(err)) from err


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
    """Open ``spec`` (video file, frame folder or camera index) or raise one clear InferenceError."""
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
    capture = cv2.VideoCapture(str(path))
    ok, first = capture.read() if capture.isOpened() else (False, None)
    if not ok:
        capture.release()
        raise InferenceError(
            f"OpenCV cannot decode a frame of {path}: not a video or an unsupported codec; "
            f"re-encode it (ffmpeg -i {path.name} -c:v libx264 out.mp4) or pass a frame folder"
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
    """Stream ``cfg.input`` through the site model and write the outputs; return the summary."""
    run_dir = Path(cfg.run)
    device = resolve_device(cfg.device)
    source = open_input(cfg.input, cfg.fps)
    try:
        experiment, model, indicator = load_site_model(
            run_dir, cfg.site, cfg.prompt_site, device, cfg.guard
        )
    except BaseException:
        source.close()
        raise
    default_dir = run_dir / "infer" / f"{cfg.site}_{Path(source.name).stem}"
    out_dir = Path(cfg.output) if cfg.output else default_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.labels:
        (out_dir / "labels").mkdir(exist_ok=True)
    image_size = tuple(experiment.clip.image_size)
    temporal = model.uses_temporal(experiment.clip_config().num_frames)
    stream = model.stream(indicator, interval_s=experiment.clip.interval_s, use_temporal=temporal)
    log.info(
        "%s: %s model of %s on %s (%s fps), network input %dx%d, clip frames %.2f s apart (%s)",
        source.name,
        cfg.site,
        run_dir,
        device,
        f"{source.fps:g}",
        *image_size,
        experiment.clip.interval_s,
        "temporal" if temporal else "single frame",
    )
    writer, frame_size, rows = None, None, []
    known = [n for n in (source.num_frames, cfg.max_frames) if n is not None]
    bar = progress_bar(
        total=min(known, default=None), unit="frame", desc="infer", enabled=cfg.progress
    )
    started = time.perf_counter()
    frames = source.frames()
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
                writer = _open_writer(out_dir / "overlay.mp4", source.fps, frame_size)
            elif rgb.shape[:2] != frame_size:
                raise InferenceError(
                    f"frame {index} of {source.name} is {rgb.shape[1]}x{rgb.shape[0]} but the "
                    f"stream started at {frame_size[1]}x{frame_size[0]}: split or resize the input "
                    f"so every frame has one size"
                )
            t1 = time.perf_counter()
            frame = normalize_frames(resize_frame(rgb, image_size)[None]).to(device)  # [1, 3, H, W]
            logits = stream.step(frame, time_s)  # [1, K, H, W]
            logits = F.interpolate(logits, size=frame_size, mode="bilinear", align_corners=False)
            label = logits[0].argmax(0).to(torch.uint8).cpu().numpy()  # [H0, W0]
            _synchronize(device)
            t2 = time.perf_counter()
            overlay = draw_legend(overlay_masks(rgb, label, cfg.alpha))
            writer.write(cv2.cvtColor(overlay, cv2.COLOR_RGB2BGR))
            if cfg.labels:
                cv2.imwrite(str(out_dir / "labels" / f"{index:09d}.png"), label)
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
    return _write_summary(cfg, source, out_dir, rows, frame_size, started)


def _open_writer(path: Path, fps: float, frame_size: tuple[int, int]) -> cv2.VideoWriter:
    height, width = frame_size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*VIDEO_FOURCC), fps, (width, height))
    if not writer.isOpened():
        raise InferenceError(f"OpenCV cannot write {path} ({VIDEO_FOURCC}, {width}x{height})")
    return writer


def _write_summary(
    cfg: InferConfig,
    source: VideoInput,
    out_dir: Path,
    rows: list[tuple],
    frame_size: tuple[int, int],
    started: float,
) -> dict[str, Any]:
    with open(out_dir / "timing.csv", "w", newline="") as handle:
        table = csv.writer(handle)
        table.writerow(TIMING_COLUMNS)
        for index, time_s, *seconds in rows:
            table.writerow([index, f"{time_s:.4f}", *(f"{s * 1e3:.2f}" for s in seconds)])
    network_s = np.array([r[3] for r in rows])
    summary = {
        "input": source.name,
        "site": cfg.site,
        "frames": len(rows),
        "frame_size": list(frame_size),
        "fps_input": source.fps,
        "fps_overall": len(rows) / (time.perf_counter() - started),
        "fps_network_mean": float(1 / network_s.mean()),
        "network_ms_median": float(np.median(network_s) * 1e3),
        "overlay": str(out_dir / "overlay.mp4"),
        "labels": str(out_dir / "labels") if cfg.labels else None,
        "timing": str(out_dir / "timing.csv"),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = parse_key_values(InferConfig, sys.argv[1:] if argv is None else argv, __doc__)
        summary = run_inference(cfg)
    except (InferenceError, ConfigError, FileNotFoundError) as err:
        sys.exit(f"fedst.infer: {err}")
    print(
        f"{summary['frames']} frames {summary['frame_size'][1]}x{summary['frame_size'][0]}: "
        f"{summary['fps_overall']:.2f} FPS overall, network {summary['fps_network_mean']:.2f} FPS; "
        f"wrote {summary['overlay']}"
    )


if __name__ == "__main__":
    main()
