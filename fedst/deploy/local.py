"""A whole deployment on one machine (``python -m fedst.deploy local``): throw-away certificates
and keys, the server and one process per site on 127.0.0.1, one federation, every process stopped
at the end (also on Ctrl-C and on failure)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fedst.deploy.credentials import make_certificates, make_site_key
from fedst.deploy.processes import APP_DIR, free_port, process_env, start, stop


def local(sites: Sequence[str], overrides: Sequence[str], workdir: Path | None = None) -> int:
    """Throw-away certificates and keys, the server and one process per site on 127.0.0.1, one
    federation, every process stopped at the end (also on Ctrl-C and on failure)."""
    from fedst.cli import compose_experiment
    from fedst.training import prepare_data

    work = workdir or Path(tempfile.mkdtemp(prefix="fedst_local_"))
    cfg, _ = compose_experiment([f"data.federation=[{','.join(sites)}]", *overrides])
    prepare_data(cfg)  # once, before the processes that would each generate it
    certs = make_certificates(work / "certs")
    for site in sites:
        make_site_key(work / "keys", site)
    port = free_port()
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
    try:
        server = start(server_cmd, work / "server.out", env)
        processes.append(server)
        for site in sites:
            command = [python, str(APP_DIR / "train_fed.py"), f"site={site}"]
            command += [f"deploy.server=127.0.0.1:{port}", f"deploy.site_port={free_port()}"]
            command += [f"deploy.state_dir={work / 'sites' / site}"]
            command += [f"hydra.run.dir={work / 'sites' / site / 'hydra'}", *common]
            processes.append(start(command, work / f"site_{site}.out", env))
        print(f"server and sites {', '.join(sites)} on 127.0.0.1:{port}; logs in {work}")
        code = server.wait()
        print((work / "server.out").read_text()[-3000:])
        return code
    finally:
        for process in reversed(processes):
            stop(process)
