"""A whole deployment on one machine (``python -m fedst.deploy local``): throw-away certificates
and keys, the server and one process per site on 127.0.0.1, each site on its own GPU when several
are visible, one federation, every process stopped at the end (also on Ctrl-C and on failure).
The work folder (the run, the logs, the sites' states) is kept under the runs folder
(:func:`default_workdir`) unless ``--workdir`` names another."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fedst.config import ConfigError
from fedst.deploy.credentials import make_certificates, make_site_key
from fedst.deploy.processes import APP_DIR, free_port, process_env, start, stop
from fedst.storage import require_output_folder

log = logging.getLogger("fedst.deploy")


def visible_gpus(device_count: int | None = None, visible: str | None = None) -> list[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES entries: those of an existing
    ``CUDA_VISIBLE_DEVICES`` list (``visible``, default the environment's; indices or UUIDs,
    kept as written; "" or "-1": none), else "0".."n-1" for ``device_count`` GPUs (default
    ``torch.cuda.device_count()``)."""
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
        # CUDA stops at the first invalid entry; "-1" is the usual way of hiding every GPU
        return entries[: entries.index("-1")] if "-1" in entries else entries
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count()
    return [str(index) for index in range(device_count)]


def site_gpus(sites: Sequence[str], gpus: Sequence[str]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES of each site process: the visible GPUs ``gpus`` round-robin over
    ``sites`` in order, so each site has a GPU of its own while there are enough (a site's
    ``cuda`` is then its own card); empty (every process sees the same GPUs) with fewer than
    two GPUs."""
    if len(gpus) < 2:
        return {}
    return {site: gpus[index % len(gpus)] for index, site in enumerate(sites)}


LOCAL_RUNS = Path("runs") / "deploy_local"
"""Where ``deploy local`` keeps its work folders by default, beside train_fed.py's runs
(``runs/<experiment>/...``, relative to the current folder like them)."""


def default_workdir(now: float | None = None) -> Path:
    """A new work folder ``runs/deploy_local/<YYYYmmdd-HHMMSS>`` (a suffix when taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    candidate, n = LOCAL_RUNS / stamp, 1
    while candidate.exists():
        n += 1
        candidate = LOCAL_RUNS / f"{stamp}_{n}"
    return candidate.resolve()


def local(sites: Sequence[str], overrides: Sequence[str], workdir: Path | None = None) -> int:
    """Throw-away certificates and keys, the server and one process per site on 127.0.0.1 (each
    site on its own GPU when several are visible: :func:`site_gpus`), one federation, every
    process stopped at the end (also on Ctrl-C and on failure).

    The work folder (certificates, keys, logs, the run in ``run/`` and the sites' states) is
    kept: ``workdir``, else a new folder under ``runs/deploy_local/`` (:func:`default_workdir`),
    named when the command starts and ends. The config is checked before any folder is made, so
    a mistake leaves nothing: ``engine`` is refused (this is Flower's deployment engine, not
    train_fed.py's in-process or Ray one), and ``workdir`` must be a folder."""
    from fedst.cli import compose_experiment

    engine = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] == "engine"]
    if engine:
        raise ConfigError(
            f"{engine[0]}: deploy local runs Flower's deployment engine (a SuperLink and one "
            "SuperNode process per site); engine= chooses train_fed.py's simulation engine, "
            "leave it out here"
        )
    if workdir is not None:
        require_output_folder(workdir, "--workdir")
    cfg, _ = compose_experiment([f"data.federation=[{','.join(sites)}]", *overrides])
    from fedst.training import prepare_data  # the stack: once the arguments are checked

    prepare_data(cfg)  # once, before the processes that would each generate it
    work = (workdir or default_workdir()).resolve()
    print(f"work folder: {work} (the run in {work / 'run'}, the logs beside it)")
    try:
        return _federation(work, sites, overrides, cfg.train.num_workers)
    finally:
        print(f"kept the work folder {work}: the run is {work / 'run'}")


def _federation(
    work: Path, sites: Sequence[str], overrides: Sequence[str], num_workers: int | str
) -> int:
    """The server and the sites of :func:`local` in ``work``; the server's exit status.
    ``num_workers``: the experiment's ``train.num_workers``."""
    from fedst.data.clips import resolve_num_workers

    certs = make_certificates(work / "certs")
    for site in sites:
        make_site_key(work / "keys", site)
    port = free_port()
    if num_workers == "auto":  # the sites load at once here: each its share of cores
        workers = resolve_num_workers("auto", parallel_loaders=len(sites))
        overrides = [o for o in overrides if not o.startswith("train.num_workers=")]
        overrides = [*overrides, f"train.num_workers={workers}"]
        log.info("each of %d site processes loads with %d worker(s)", len(sites), workers)
    common = [
        f"deploy.certs={certs}",
        f"deploy.keys={work / 'keys'}",
        f"data.federation=[{','.join(sites)}]",
        "progress=false",
        *overrides,
    ]
    run_dir = work / "run"
    python = sys.executable
    server_cmd = [python, str(APP_DIR / "train_fed.py"), "site=server", "deploy.host=127.0.0.1"]
    server_cmd += [f"deploy.port={port}", f"hydra.run.dir={run_dir}", *common]
    processes: list[subprocess.Popen] = []
    env = process_env()
    gpus = visible_gpus()
    assigned = site_gpus(sites, gpus)
    if assigned:
        log.info(
            "%d GPUs for %d sites: %s (CUDA_VISIBLE_DEVICES of each site process; the server "
            "sees them all)",
            len(gpus),
            len(sites),
            ", ".join(f"site {site} -> GPU {gpu}" for site, gpu in assigned.items()),
        )
    elif gpus:
        log.info("one GPU (%s): the server and every site share it", gpus[0])
    work.mkdir(parents=True, exist_ok=True)
    try:
        server = start(server_cmd, work / "server.out", env)
        processes.append(server)
        for site in sites:
            command = [python, str(APP_DIR / "train_fed.py"), f"site={site}"]
            command += [f"deploy.server=127.0.0.1:{port}", f"deploy.site_port={free_port()}"]
            command += [f"deploy.state_dir={work / 'sites' / site}"]
            command += [f"hydra.run.dir={work / 'sites' / site / 'hydra'}", *common]
            site_env = {**env, "CUDA_VISIBLE_DEVICES": assigned[site]} if site in assigned else env
            processes.append(start(command, work / f"site_{site}.out", site_env))
        print(f"server and sites {', '.join(sites)} on 127.0.0.1:{port}; logs in {work}")
        code = server.wait()
        print((work / "server.out").read_text()[-3000:])
        return code
    finally:
        for process in reversed(processes):
            stop(process)
