"""The streaming model of an inference: a finished run's site model (PyTorch, optionally
DAD-corrected) or its exported graph (ONNX Runtime), and the loop that feeds it the input's frames
and writes the outputs (:func:`run_inference`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import cv2
import torch
import torch.nn.functional as F

from fedst.accel import resolve_device
from fedst.data.clips import normalize_frames, resize_frame
from fedst.experiment import ExperimentConfig
from fedst.infer.command import InferConfig, InferenceError
from fedst.infer.latency import PacedFrames
from fedst.infer.outputs import (
    OVERLAY,
    StagedOutputs,
    draw_legend,
    open_overlay_writer,
    write_summary,
)
from fedst.infer.video import open_input
from fedst.model.network import FedSTNet
from fedst.progress import progress_bar
from fedst.report.plots import overlay_masks
from fedst.runs import Run
from fedst.storage import require_output_folder

log = logging.getLogger("fedst.infer")

OUTFED = "outfed"


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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_inference(cfg: InferConfig) -> dict[str, Any]:
    """Stream ``cfg.input`` through the site model and write the outputs; return the summary.

    The outputs appear together, once complete (:class:`StagedOutputs`): an error part-way
    leaves the output folder as it was; Ctrl-C keeps the frames so far."""
    run_dir = Path(cfg.run)
    if cfg.realtime and cfg.input.isdigit():
        raise InferenceError(
            f"realtime=true paces a video file or frame folder at its frame rate; input="
            f"{cfg.input} is a camera, which delivers frames in real time already: drop realtime="
        )
    if cfg.warmup_frames < 0:
        raise InferenceError(f"warmup_frames={cfg.warmup_frames}: give 0 or more frames")
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
    paced = PacedFrames(source.frames()) if cfg.realtime else None
    frames = paced if paced is not None else source.frames()
    with StagedOutputs(out_dir, labels=cfg.labels) as outputs:
        try:
            index = 0
            while cfg.max_frames is None or index < cfg.max_frames:
                asked = time.perf_counter()
                item = next(frames, None)
                if item is None:
                    break
                if paced is not None:  # from its arrival: the wait for a busy pipeline counts
                    time_s, rgb, t0 = item.time_s, item.rgb, item.arrival
                else:
                    (time_s, rgb), t0 = item, asked
                if frame_size is None:
                    frame_size = rgb.shape[:2]
                    writer = open_overlay_writer(outputs.file(OVERLAY), source.fps, frame_size)
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
                # read: from the later of asking and arrival; total: end to end from t0
                rows.append((index, time_s, t1 - max(asked, t0), t2 - t1, t3 - t2, t3 - t0))
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
        pacing = {"realtime": cfg.realtime, "dropped_frames": paced.dropped if paced else None}
        summary = write_summary(
            cfg, source, outputs, rows, frame_size, started, guard, network, pacing
        )
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
