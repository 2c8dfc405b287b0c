"""The GPU check's ``schedule`` step (issue 60, item 6): what the paper's schedule costs on this
device, measured in one process from FedST's own site, SERQ and evaluation code.

    python -m bench.gpu_check schedule --device cuda --size 512 640 --data-root DIR --work DIR \
        --json schedule.json

For each compile mode (``--modes``; GPU: none, reduce-overhead, default, each from a cold model;
eager's site and SERQ first, then each compiled mode's site, then compiled SERQ, as the budget
allows):

* **the site round** of the paper's config (experiment=paper at ``--size``, the procedural
  ``gpu_check`` preset's frames resized to it) at 5, 20 and 60 local iterations after a warm-up
  round of 3, through ``Site.train_round`` (adopt, the iterations, the bulk copies, the state
  writer): the fixed cost F and the per-iteration cost t of ``wall = F + k t`` by least squares
  (:func:`fit_round_cost`), with the residuals; the warm-up round's excess over ``F + 3 t`` (the
  cold compile, cuDNN's autotuning, the loader's start); the loader wait per ``next_batch`` call;
* **CUDA-event step times** (the compiled step's forward, backward and optimizer step between two
  events, read after the round) over the 60-iteration round: median and p90;
* **the GPU busy fraction**: the kernels' time from ``torch.profiler`` over ``--steady``
  iterations of the step divided by their wall time (iterations after the rounds, so steady);
* **no host sync**: the same ``--steady`` iterations again under
  ``torch.cuda.set_sync_debug_mode("error")`` (any synchronising call raises; issue 60, item 5);
* **SERQ per batch**: a round of ``--serq-batches`` batches (EQ and SC) after a first round
  that fills the bank; **pre-training per iteration** after 2 warm-up iterations;

then, once, **one evaluation** of the site's test split (seconds per frame, loader start
included) and **the paper's schedule** per mode: 300 rounds x (4 sites x (F + 100 t) + 100 SERQ
batches) + 30 evaluations of the A-D test frames + 3000 pre-training iterations
(bench/round_costs.py ``PaperJob``), each term listed (:func:`paper_schedule`).

On the CPU every CUDA-only figure reads :data:`NO_CUDA` (nothing is estimated in its place), the
compile modes other than ``none`` are not run (Inductor's C++ build of this network takes about 11
minutes on this project's 2 cores; the CPU parity of the compiled step is
tests/test_compiled_step.py), and the fit and the arithmetic run as on the GPU. A part that the
budget (``--budget-s``) no longer allows is recorded as "not run: budget", and the JSON is
rewritten after every part.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.round_costs import PaperJob

log = logging.getLogger("gpu_check")

NO_CUDA = "not measured: no CUDA"
ROUND_ITERS = (5, 20, 60)
"""Local iterations of the measured site rounds (the fit's points)."""
WARMUP_ITERS = 3
"""Local iterations of the warm-up round (compile, autotuning, loader start)."""
NOT_RUN = "not run: budget"
PAPER_JOB = PaperJob()


def fit_round_cost(points: Sequence[tuple[int, float]]) -> dict[str, float]:
    """Least squares of ``wall = F + k t`` over ``(k, wall)`` points (at least two distinct k):
    {"F_s", "t_s", "max_residual_s"}."""
    ks = [float(k) for k, _ in points]
    walls = [float(w) for _, w in points]
    if len(set(ks)) < 2:
        raise ValueError(f"fit_round_cost: needs two distinct iteration counts, got {ks}")
    k_mean, w_mean = statistics.fmean(ks), statistics.fmean(walls)
    spread = sum((k - k_mean) ** 2 for k in ks)
    t = sum((k - k_mean) * (w - w_mean) for k, w in zip(ks, walls, strict=True)) / spread
    fixed = w_mean - t * k_mean
    residual = max(abs(w - fixed - t * k) for k, w in zip(ks, walls, strict=True))
    return {"F_s": fixed, "t_s": t, "max_residual_s": residual}


def paper_schedule(
    fixed_s: float,
    iteration_s: float,
    serq_batch_s: float,
    evaluation_frame_s: float,
    pretrain_iteration_s: float,
    job: PaperJob = PAPER_JOB,
) -> dict[str, float]:
    """The paper's schedule in hours, term by term: ``rounds x sites x (F + local_iters t)``,
    ``rounds x serq_batches x SERQ's batch``, ``rounds / eval_every`` evaluations of the test
    frames, and ``pretrain_iters`` pre-training iterations; "total_h" their sum."""
    terms = {
        "sites_h": job.rounds * job.sites * (fixed_s + job.local_iters * iteration_s) / 3600,
        "site_fixed_h": job.rounds * job.sites * fixed_s / 3600,
        "serq_h": job.rounds * job.serq_batches * serq_batch_s / 3600,
        "evaluation_h": job.rounds // job.eval_every * job.test_frames * evaluation_frame_s / 3600,
        "pretraining_h": job.pretrain_iters * pretrain_iteration_s / 3600,
    }
    total = terms["sites_h"] + terms["serq_h"] + terms["evaluation_h"] + terms["pretraining_h"]
    return {**terms, "total_h": total}


class Budget:
    """Seconds left of ``budget_s`` since construction."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s, self.started = budget_s, time.monotonic()

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)


class StepTimer:
    """CUDA events around every call of a site's compiled step (no host wait while recording;
    :meth:`milliseconds` synchronises once)."""

    def __init__(self, step: Any) -> None:
        import torch

        self.step, self.events = step, []
        self._original = step.step
        self._torch = torch

        def timed(*args: Any, **kwargs: Any) -> Any:
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            out = self._original(*args, **kwargs)
            end.record()
            self.events.append((begin, end))
            return out

        step.step = timed

    def close(self) -> None:
        del self.step.step  # the class's method again

    def milliseconds(self) -> list[float]:
        self._torch.cuda.synchronize()
        return [begin.elapsed_time(end) for begin, end in self.events]


def _config(args: argparse.Namespace, mode: str, extra: Sequence[str] = ()) -> Any:
    from fedst.cli import compose_experiment

    height, width = args.size
    overrides = [
        "experiment=paper",
        "data=tiny",
        "data.procedural=gpu_check",
        f"data.root={args.data_root}",
        f"clip.image_size=[{height},{width}]",
        "network.pretrained=false",
        "method.indicator=onehot",
        f"train.device={args.device}",
        f"train.compile={mode}",
        "train.eval_max_frames=null",
        f"serq.batches_per_round={args.serq_batches}",
        *(["train.num_workers=0"] if args.device == "cpu" else []),
        *extra,
    ]
    cfg, _ = compose_experiment(overrides)
    return cfg


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _steady_batches(site: Any, count: int) -> list[tuple]:
    """``count`` batches of the site's stream, on the device (loaded before the timed window),
    as ``train_phase`` feeds the step (``Site.step_inputs``: channels_last, every clip frame's
    masks under ``train.clip_frame_loss_weight``)."""
    return [site.step_inputs(*site.stream.next_batch()[:2]) for _ in range(count)]


def _run_steps(site: Any, batches: list[tuple], indicator: Any) -> None:
    """The site's compiled step on ``batches`` (on the device) with ``indicator`` (on the
    device: moved once, before any timed or checked window, as ``train_phase`` does)."""
    for clips, masks, frame_masks in batches:
        site.training_step.step(
            (clips, indicator, masks, frame_masks),
            site.optimizer,
            site.scaler,
            site.model.parameters(),
            site.cfg.train.max_grad_norm,
        )


def _indicator(site: Any) -> Any:
    return site.indicator.to(site.device) if site.indicator is not None else None


def busy_fraction(site: Any, batches: list[tuple]) -> dict[str, Any]:
    """Kernel time / wall over the steps on ``batches`` (CUDA only), from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    indicator = _indicator(site)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        _run_steps(site, batches, indicator)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernel_us = sum(
        e.time_range.elapsed_us()
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return {
        "busy_fraction": kernel_us / 1e6 / wall,
        "kernel_ms_per_step": kernel_us / 1e3 / len(batches),
        "wall_ms_per_step": 1e3 * wall / len(batches),
        "steps": len(batches),
        "note": "profiler overhead included in the wall; kernels replayed inside CUDA graphs "
        "count where CUPTI reports them",
    }


def sync_check(site: Any, batches: list[tuple]) -> str:
    """The steps on ``batches`` under ``set_sync_debug_mode("error")``: "ok" or the error."""
    import torch

    indicator = _indicator(site)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run_steps(site, batches, indicator)
    except Exception as error:  # the sync's RuntimeError, or what else stopped the steps
        return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return "ok"


def measure_site(args: argparse.Namespace, mode: str, work: Path) -> dict[str, Any]:
    """The site rounds, step times, busy fraction and sync check of one compile mode."""
    import torch

    from fedst.federation.site import Site

    cuda = args.device == "cuda"
    cfg = _config(args, mode, [f"train.local_iters={max(ROUND_ITERS)}"])
    name = cfg.data.federation[0]
    built = time.perf_counter()
    site = Site(name, cfg, work / f"site_{mode}", torch.device(args.device))
    result: dict[str, Any] = {"site": name, "build_s": time.perf_counter() - built}
    received = {k: v.detach().clone() for k, v in site.model.state_dict().items()}
    rounds = []
    timer = None
    for server_round, iters in enumerate((WARMUP_ITERS, *ROUND_ITERS), start=1):
        if cuda and iters == max(ROUND_ITERS):
            timer = StepTimer(site.training_step)
        started = time.perf_counter()
        reply = site.train_round(received, server_round, iters)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
        rounds.append({"iters": iters, "wall_s": wall, "loader_s": reply.loader_seconds})
        received = reply.shared
    fit = fit_round_cost([(r["iters"], r["wall_s"]) for r in rounds[1:]])
    first = rounds[0]
    result |= {
        "rounds": rounds,
        **fit,
        "first_round_excess_s": first["wall_s"] - (fit["F_s"] + first["iters"] * fit["t_s"]),
        "loader_wait_ms_per_call": 1e3
        * sum(r["loader_s"] for r in rounds[1:])
        / sum(r["iters"] for r in rounds[1:]),
        "compiled_mode": site.training_step.mode,
        "compile_fallback": site.training_step.fallback_reason,
    }
    if timer is not None:
        timer.close()
        step_ms = timer.milliseconds()
        result["cuda_event_step_ms"] = {
            "median": statistics.median(step_ms),
            "p90": _percentile(step_ms, 0.9),
            "steps": len(step_ms),
        }
        result["t_over_step"] = 1e3 * fit["t_s"] / statistics.median(step_ms)
    else:
        result["cuda_event_step_ms"] = NO_CUDA
    if cuda:
        site.model.train()
        result["busy"] = busy_fraction(site, _steady_batches(site, args.steady))
        result["sync_debug_error_mode"] = sync_check(site, _steady_batches(site, args.steady))
    else:
        result["busy"] = NO_CUDA
        result["sync_debug_error_mode"] = NO_CUDA
    result["evaluation"] = _evaluation(site, received, len(rounds))
    site.close_loaders()
    return result


def _evaluation(site: Any, received: dict, server_round: int) -> dict[str, Any]:
    """One evaluation of the site's test split after ``server_round``: seconds, frames."""
    started = time.perf_counter()
    scores = site.evaluate(received, server_round)
    seconds = time.perf_counter() - started
    frames = sum(int(r.summary.get("num_frames", 0)) for r in scores.values())
    return {"seconds": seconds, "frames": frames, "seconds_per_frame": seconds / max(frames, 1)}


def measure_serq(args: argparse.Namespace, mode: str, work: Path) -> dict[str, Any]:
    """Pre-training per iteration and SERQ per batch (EQ + SC) in one compile mode."""
    import torch

    from fedst.accel import resolve_precision
    from fedst.methods import method_of
    from fedst.methods.server_step import ServerContext

    cfg = _config(args, mode)
    device = torch.device(args.device)
    method = method_of(cfg)
    model = method.build_model().to(device)
    if hasattr(model, "prepare_temporal"):
        model.prepare_temporal(tuple(cfg.clip.image_size))
    run_dir = work / f"server_{mode}"
    run_dir.mkdir(parents=True, exist_ok=True)
    precision = resolve_precision(cfg.train.amp_dtype, device)
    step = method.server_step(ServerContext(model, device, precision, run_dir))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step.pretrain(2)  # warm-up
    sync()
    started = time.perf_counter()
    step.pretrain(args.pretrain_iters)
    sync()
    pretrain_s = (time.perf_counter() - started) / args.pretrain_iters
    step.step(model, 1)  # the first round: the optimizers' state, the bank's first entries
    sync()
    started = time.perf_counter()
    stats = step.step(model, 2)
    sync()
    wall = time.perf_counter() - started
    step.serq.stream.close()
    step.close()
    return {
        "pretrain_s_per_iter": pretrain_s,
        "serq_s_per_batch": wall / args.serq_batches,
        "serq_eq_s": stats["eq_seconds"],
        "serq_sc_s": stats["sc_seconds"],
        "serq_batches": args.serq_batches,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every part, in order, within the budget; the JSON rewritten after each."""
    from fedst.training import prepare_benchmark

    budget = Budget(args.budget_s)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    prepare_benchmark(_config(args, "none"), progress=False)  # as train_fed.py generates it
    modes = args.modes if args.device == "cuda" else ["none"]
    report: dict[str, Any] = {
        "device": args.device,
        "size": list(args.size),
        "round_iters": [WARMUP_ITERS, *ROUND_ITERS],
        "modes": {},
        "not_run": {m: NO_CUDA for m in args.modes if m not in modes},
    }
    for mode in modes:
        report["modes"][mode] = {}
    # eager's site and SERQ (every schedule's fallback units), then each compiled mode's site
    # (the GPU's goal is the reduce-overhead step), then SERQ compiled, as the budget allows
    parts = [(m, p, run) for m in modes if m == "none" for p, run in PARTS]
    parts += [(m, "site", measure_site) for m in modes if m != "none"]
    parts += [(m, "server", measure_serq) for m in modes if m != "none"]
    for mode, part, run in parts:
        entry = report["modes"][mode]
        needed = args.part_min_s * (1 if mode == "none" else 3)  # a compile takes a minute there
        if budget.left() < needed:
            entry[part] = NOT_RUN
            continue
        log.info("schedule: %s in mode %s (%.0f s left)", part, mode, budget.left())
        try:
            entry[part] = run(args, mode, work)
        except Exception as error:  # one mode failing must not hide the others' figures
            log.exception("schedule: %s in mode %s failed", part, mode)
            entry[part] = f"failed: {type(error).__name__}: {str(error)[:300]}"
        _write(args.json, report)
    for mode in modes:
        entry = report["modes"][mode]
        entry["paper_schedule_h"] = _schedule_of(entry, report["modes"].get("none", {}))
    _write(args.json, report)
    return report


PARTS = (("site", measure_site), ("server", measure_serq))


def _schedule_of(entry: dict, eager: dict) -> dict[str, Any] | str:
    """The paper's schedule from one mode's units (SERQ from that mode, else eager's, as
    ``serq_from`` says)."""
    site, server, serq_from = entry.get("site"), entry.get("server"), "this mode"
    if not isinstance(server, dict):
        server, serq_from = eager.get("server"), "mode none"
    if not isinstance(site, dict) or not isinstance(server, dict):
        return "not computed: a unit is missing"
    hours = paper_schedule(
        site["F_s"],
        site["t_s"],
        server["serq_s_per_batch"],
        site["evaluation"]["seconds_per_frame"],
        server["pretrain_s_per_iter"],
    )
    return {**hours, "serq_from": serq_from}


def markdown(report: dict) -> list[str]:
    """The schedule step's figures for gpu_check.md: one table row per mode, then each mode's
    paper schedule term by term."""
    lines = [
        "| mode | F s | t s | max residual s | first round excess s | loader ms / call "
        "| step ms (CUDA events, median) | busy | sync check | SERQ s / batch | eval s / frame |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    schedules = []
    for mode, entry in report.get("modes", {}).items():
        site, server = entry.get("site"), entry.get("server")
        site = site if isinstance(site, dict) else {"F_s": site}
        server = server if isinstance(server, dict) else {"serq_s_per_batch": server}
        step = site.get("cuda_event_step_ms")
        busy = site.get("busy")
        cells = [
            site.get("F_s"),
            site.get("t_s"),
            site.get("max_residual_s"),
            site.get("first_round_excess_s"),
            site.get("loader_wait_ms_per_call"),
            step.get("median") if isinstance(step, dict) else step,
            busy.get("busy_fraction") if isinstance(busy, dict) else busy,
            site.get("sync_debug_error_mode"),
            server.get("serq_s_per_batch"),
            (site.get("evaluation") or {}).get("seconds_per_frame"),
        ]
        lines.append(f"| {mode} | " + " | ".join(_cell(c) for c in cells) + " |")
        hours = entry.get("paper_schedule_h")
        if isinstance(hours, dict):
            terms = ", ".join(f"{k} {_cell(v)}" for k, v in hours.items())
            schedules.append(f"* the paper's schedule, mode {mode}: {terms}")
        else:
            schedules.append(f"* the paper's schedule, mode {mode}: {hours}")
    not_run = report.get("not_run") or {}
    return [*lines, "", *schedules, *(f"* mode {m}: {why}" for m, why in not_run.items())]


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")[:120]


def _write(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=1, default=str))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, nargs=2, default=(512, 640))
    parser.add_argument("--modes", nargs="+", default=["none", "reduce-overhead", "default"])
    parser.add_argument("--data-root", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="site states, SERQ's bank")
    parser.add_argument("--steady", type=int, default=10, help="iterations: busy, sync check")
    parser.add_argument("--serq-batches", type=int, default=10)
    parser.add_argument("--pretrain-iters", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=190)
    parser.add_argument(
        "--part-min-s", type=float, default=20,
        help="skip a part with less left (3x for a compiled mode)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, required=True)


def run(args: argparse.Namespace, measure_all: Callable[..., dict] = measure) -> None:
    report = measure_all(args)
    _write(args.json, report)
    for mode, entry in report["modes"].items():
        schedule = entry.get("paper_schedule_h")
        total = schedule.get("total_h") if isinstance(schedule, dict) else schedule
        log.info("schedule: mode %s: the paper's schedule %s h", mode, total)
