"""The coordinating server (``train_fed.py site=server``): a SuperLink with TLS and SuperNode
authentication, every federated site's public key registered, the flwr CLI's connection written to
its FLWR_HOME (:func:`superlink`), and one run started with ``flwr run`` and the run config of the
deployed ServerApp (:func:`serve`)."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fedst.deploy.credentials import require_file, site_key_path
from fedst.deploy.processes import (
    APP_DIR,
    BIN,
    DeploymentError,
    detached_children,
    process_env,
    start,
    stop,
    stop_detached,
    wait_for_port,
)
from fedst.experiment import DeployConfig, ExperimentConfig
from fedst.runs.layout import FINAL_JSON, FLWR_RUN_LOG, LOG_TXT

log = logging.getLogger("fedst.deploy")  # the package's name, as before the split


CONNECTION = "fedst"
"""Name of the SuperLink connection in $FLWR_HOME/config.toml."""

SUPEREXEC_EXIT = 10.0
"""Seconds a stopped SuperLink's SuperExec gets to exit by itself before it is signalled: it
notices within 0.2 s and Flower forces its exit after 5 s (flwr/supercore/app_utils.py
``start_parent_process_monitor``, flwr/supercore/constant.py ``FORCE_EXIT_TIMEOUT_SECONDS``)."""


def write_connection(flwr_home: Path, address: str, ca: Path | None) -> None:
    """$FLWR_HOME/config.toml with the SuperLink connection ``fedst`` used by the flwr CLI."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]"]
    lines.append(f'address = "{address}"')
    lines.append(f'root-certificates = "{ca}"' if ca else "insecure = true")
    (flwr_home / "config.toml").write_text("\n".join(lines) + "\n")


def superlink_command(dcfg: DeployConfig, certs: Path | None) -> list[str]:
    command = [str(BIN / "flower-superlink"), "--host", dcfg.host, "--port", str(dcfg.port)]
    command.append("--disable-runtime-dependency-installation")
    if certs is None:
        return [*command, "--insecure"]
    return [
        *command,
        "--ssl-ca-certfile",
        str(certs / "ca.crt"),
        "--ssl-certfile",
        str(certs / "server.pem"),
        "--ssl-keyfile",
        str(certs / "server.key"),
        "--enable-supernode-auth",
    ]


def register_sites(sites: Sequence[str], keys: Path, env: dict[str, str]) -> None:
    """``flwr supernode register`` every site's public key (only registered keys may join)."""
    for site in sites:
        public = require_file(
            site_key_path(keys, site).with_suffix(".pub"),
            f"site {site}'s public key",
            f"copy the hospital's {site}_key.pub there (made by python -m fedst.deploy key "
            f"--site {site}), or point deploy.keys at the folder that has it",
        )
        done = subprocess.run(
            [str(BIN / "flwr"), "supernode", "register", str(public), CONNECTION, "--name", site],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise DeploymentError(f"registering site {site}'s key failed: {done.stdout.strip()}")
        log.info("registered site %s (%s)", site, public)


def run_config_overrides(run_dir: Path, dcfg: DeployConfig) -> str:
    """The ``--run-config`` of ``flwr run`` (keys of [tool.flwr.app.config] in pyproject.toml):
    the run directory and the server's policy (DeployConfig.to_run_config, the one codec)."""
    values = {"run-dir": str(run_dir.resolve()), **dcfg.to_run_config()}
    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())


@contextlib.contextmanager
def running_superlink(
    sites: Sequence[str], dcfg: DeployConfig, log_dir: Path
) -> Iterator[dict[str, str]]:
    """A running SuperLink (TLS and SuperNode authentication unless ``deploy.insecure``) with the
    public keys of ``sites`` registered and the ``fedst`` connection of the flwr CLI written to
    its FLWR_HOME (``deploy.flwr_home``, default ``<log_dir>/flwr``); yields the environment of
    the flwr CLI (``flwr run <app> fedst ...``) and stops the SuperLink at the end, and with it
    the SuperExec it started in a session of its own (and that one's ServerApp), waiting for them
    to exit (:func:`fedst.deploy.processes.stop_detached`)."""
    certs = None
    if not dcfg.insecure:
        certs = Path(dcfg.certs)
        for name in ("ca.crt", "server.pem", "server.key"):
            require_file(
                certs / name,
                "TLS file",
                "make certificates with python -m fedst.deploy certs --out <folder> --hosts "
                "<this server's name or IP>, then set deploy.certs=<folder>",
            )
        certs = certs.resolve()
    flwr_home = Path(dcfg.flwr_home or log_dir / "flwr").resolve()
    connect_host = "127.0.0.1" if dcfg.host in ("0.0.0.0", "::") else dcfg.host
    address = f"{connect_host}:{dcfg.port}"
    write_connection(flwr_home, address, certs / "ca.crt" if certs else None)
    env = process_env(flwr_home, dcfg)
    process = start(superlink_command(dcfg, certs), log_dir / "superlink.log", env, False)
    try:
        wait_for_port(connect_host, dcfg.port, 60, process)
        if certs is not None:
            register_sites(sites, Path(dcfg.keys), env)
        log.info(
            "SuperLink on %s:%d; waiting up to %.0f s for sites %s",
            dcfg.host,
            dcfg.port,
            dcfg.join_timeout,
            ", ".join(sites),
        )
        yield env
    finally:
        superexec = detached_children(process)  # before the SuperLink goes: then it is ours
        stop(process)
        stop_detached(superexec, grace=SUPEREXEC_EXIT)


def serve(cfg: ExperimentConfig, run_dir: Path, dcfg: DeployConfig) -> dict[str, Any]:
    """``train_fed.py site=server``: SuperLink up, sites registered, one run, SuperLink down.
    A ``run_dir`` that holds a server checkpoint (``train_fed.py site=server resume=<run dir>``)
    continues after its last completed round (fedst.app.server_app.run_federation)."""
    from fedst.training import prepare_run

    prepare_run(cfg, run_dir, progress=False, federated_data=False)
    with running_superlink(cfg.data.federation, dcfg, run_dir) as env:
        command = [str(BIN / "flwr"), "run", str(APP_DIR), CONNECTION, "--stream"]
        command += ["--run-config", run_config_overrides(run_dir, dcfg)]
        flwr_run = start(command, run_dir / FLWR_RUN_LOG, env, False)
        while flwr_run.poll() is None and not (run_dir / FINAL_JSON).exists():
            time.sleep(1.0)
        if flwr_run.poll() is None:  # --stream may linger after the run has finished
            stop(flwr_run, grace=5)
    final = run_dir / FINAL_JSON
    if not final.exists():
        raise DeploymentError(
            f"the federation did not finish: see {run_dir / LOG_TXT} and {run_dir / FLWR_RUN_LOG}"
        )
    return json.loads(final.read_text())
