"""Run FedST across hospitals with Flower's deployment engine (SuperLink + one SuperNode per site).

    python train_fed.py site=server deploy.certs=certs deploy.keys=keys   # the coordinating server
    python train_fed.py site=A deploy.server=<host>:9092 deploy.certs=certs deploy.keys=keys
    python -m fedst.deploy local --sites A B C D [experiment=tiny ...]    # everything on 127.0.0.1
    python -m fedst.deploy certs --out certs --hosts server.example.org 10.0.0.5
    python -m fedst.deploy key --out keys --site A

The server process starts ``flower-superlink`` (TLS, SuperNode authentication), registers the
public key of every federated site found in ``deploy.keys``, starts the run with ``flwr run``
(the ServerApp of fedst/app/server_app.py, run config from pyproject.toml) and stops the SuperLink
at the end. A site process starts ``flower-supernode`` with its own node config (site name, data
folder, state folder, device, workers; fedst.experiment.SiteNodeConfig) with ``--isolation
process``, and next to it one long-lived ClientApp process (fedst.app.site_executor) that runs
every message of the run, so imports and the site's model and data are built once. Messages
carry only the
site view of the experiment, shared parameters and scalar metrics (docs/deployment.md).

Nothing here is needed by the in-process engine; the apps are the same in both.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import ipaddress
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fedst.app.nodes import site_node_config
from fedst.config import ConfigError
from fedst.experiment import (
    DeployConfig,
    ExperimentConfig,
    RoundPolicy,
)

log = logging.getLogger(__name__)

APP_DIR = Path(__file__).resolve().parents[1]
"""The Flower app (pyproject.toml with [tool.flwr.app]) that ``flwr run`` bundles."""
CONNECTION = "fedst"
"""Name of the SuperLink connection in $FLWR_HOME/config.toml."""
CONNECTED = "SuperNode ID:"
"""What flower-supernode logs once the SuperLink has activated it."""
EXIT_AUTH_FAILED = 305
"""flower-supernode's exit code when the SuperLink refuses to activate it."""
BIN = Path(sys.executable).parent


class DeploymentError(RuntimeError):
    """A deployment problem with a one-line explanation that names the fix."""


# -- certificates and keys -----------------------------------------------------------------------


def make_certificates(out: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> Path:
    """A throw-away CA (``ca.crt``) and a server certificate for ``hosts`` (``server.pem``,
    ``server.key``). For a real trial, a certificate from the hospital's own CA is preferable."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "FedST CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (out / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (out / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "server.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(out / "server.key", 0o600)
    return out


def site_key_path(keys: Path, site: str) -> Path:
    """A site's private key; its public key is the same path with ``.pub``."""
    return keys / f"{site}_key"


def make_site_key(keys: Path, site: str) -> Path:
    """An EC (NIST P-384) key pair in OpenSSH format, as Flower's SuperNode authentication wants.
    The hospital keeps ``<site>_key``; the server's admin gets ``<site>_key.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    keys.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    path = site_key_path(keys, site)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    os.chmod(path, 0o600)
    path.with_suffix(".pub").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + f" fedst-site-{site}\n".encode()
    )
    return path


# -- processes -----------------------------------------------------------------------------------


def process_env(flwr_home: Path | None = None, dcfg: DeployConfig | None = None) -> dict[str, str]:
    """Environment of every Flower process: one torch thread, no telemetry, this checkout first
    on the path, no per-run dependency installation, the transfer settings of ``dcfg``
    (``deploy.transfers_in_flight``, ``deploy.chunk_mib``; default: DeployConfig's)."""
    env = {
        **os.environ,
        **(dcfg or DeployConfig()).flower_env(),
        "OMP_NUM_THREADS": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(APP_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        "PYTHONUNBUFFERED": "1",
        "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),  # Flower starts
        # flower-superexec, flwr-serverapp and flwr-clientapp by name
    }
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env


def start(
    command: list[str], log_path: Path, env: dict[str, str], new_group: bool = True
) -> subprocess.Popen:
    """Start ``command`` with output to ``log_path``, in its own process group by default (so that
    :func:`stop` ends it together with the processes it starts)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handle = log_path.open("ab")
    log.debug("starting %s", shlex.join(command))
    return subprocess.Popen(
        command,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=APP_DIR,
        start_new_session=new_group,
    )


def stop(process: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group of ``process``, SIGKILL it after ``grace`` seconds. A process
    started in our own group (``start(..., new_group=False)``) is stopped alone."""
    try:
        leader = os.getpgid(process.pid) == process.pid
    except ProcessLookupError:  # already reaped
        leader = False
    if not leader:
        stop_child(process, grace)
        return
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # what the leader left behind
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DeploymentError(f"the SuperLink exited with code {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.3)
    raise DeploymentError(f"the SuperLink did not open {host}:{port} within {timeout:.0f} s")


@contextlib.contextmanager
def terminate_on_signal() -> Iterator[None]:
    """Turn SIGTERM into SystemExit, so that ``finally`` blocks stop the child processes."""

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _require(path: Path, what: str, fix: str) -> Path:
    if not path.is_file():
        raise DeploymentError(f"{what} {path} is missing: {fix}")
    return path.resolve()


# -- the server ----------------------------------------------------------------------------------


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
        public = _require(
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


def run_config_overrides(run_dir: Path, policy: RoundPolicy) -> str:
    """The ``--run-config`` of ``flwr run`` (keys of [tool.flwr.app.config] in pyproject.toml)."""
    values = {
        "run-dir": str(run_dir.resolve()),
        "min-sites": policy.min_sites or 0,
        "round-timeout": float(policy.round_timeout or 0.0),
        "eval-timeout": float(policy.eval_timeout or 0.0),
        "join-timeout": float(policy.join_timeout),
        "audit": policy.audit,
        "reply-poll": float(policy.reply_poll),
    }
    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())


@contextlib.contextmanager
def superlink(sites: Sequence[str], dcfg: DeployConfig, log_dir: Path) -> Iterator[dict[str, str]]:
    """A running SuperLink (TLS and SuperNode authentication unless ``deploy.insecure``) with the
    public keys of ``sites`` registered and the ``fedst`` connection of the flwr CLI written to
    its FLWR_HOME (``deploy.flwr_home``, default ``<log_dir>/flwr``); yields the environment of
    the flwr CLI (``flwr run <app> fedst ...``) and stops the SuperLink at the end."""
    certs = None
    if not dcfg.insecure:
        certs = Path(dcfg.certs)
        for name in ("ca.crt", "server.pem", "server.key"):
            _require(
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
        stop(process)


def serve(cfg: ExperimentConfig, run_dir: Path, dcfg: DeployConfig) -> dict[str, Any]:
    """``train_fed.py site=server``: SuperLink up, sites registered, one run, SuperLink down.
    A ``run_dir`` that holds a server checkpoint (``train_fed.py site=server resume=<run dir>``)
    continues after its last completed round (fedst.app.server_app.run_federation)."""
    from fedst.training import prepare_run

    prepare_run(cfg, run_dir, progress=False, federated_data=False)
    with superlink(cfg.data.federation, dcfg, run_dir) as env:
        command = [str(BIN / "flwr"), "run", str(APP_DIR), CONNECTION, "--stream"]
        command += ["--run-config", run_config_overrides(run_dir, dcfg.policy())]
        flwr_run = start(command, run_dir / "flwr_run.log", env, False)
        while flwr_run.poll() is None and not (run_dir / "final.json").exists():
            time.sleep(1.0)
        if flwr_run.poll() is None:  # --stream may linger after the run has finished
            stop(flwr_run, grace=5)
    final = run_dir / "final.json"
    if not final.exists():
        raise DeploymentError(
            f"the federation did not finish: see {run_dir / 'log.txt'} and "
            f"{run_dir / 'flwr_run.log'}"
        )
    return json.loads(final.read_text())


# -- a site --------------------------------------------------------------------------------------


def supernode_command(
    cfg: ExperimentConfig,
    site: str,
    dcfg: DeployConfig,
    progress: bool = False,
    max_wait: float | None = None,
) -> list[str]:
    """``flower-supernode`` for ``site`` with its node config (absolute paths: the ClientApp
    runs in another working directory); it gives up reconnecting to the SuperLink after
    ``max_wait`` seconds (default ``deploy.connect_timeout``)."""
    spec = cfg.data.sites[site]
    node = site_node_config(
        cfg,
        site,
        progress=progress,
        state_dir=str(Path(dcfg.state_dir).resolve()),
        share_personal=dcfg.share_personal,
    )
    node = dataclasses.replace(
        node,
        data_path=str(Path(spec.root).resolve()),
        clip_cache=str(Path(node.clip_cache).resolve()),
    )
    command = [str(BIN / "flower-supernode"), "--superlink", dcfg.server]
    command += ["--host", "127.0.0.1", "--port", str(dcfg.site_port)]
    command += ["--isolation", "process", "--node-config", node.to_cli()]
    command += ["--max-wait-time", str(dcfg.connect_timeout if max_wait is None else max_wait)]
    if dcfg.insecure:
        return [*command, "--insecure"]
    certs, keys = Path(dcfg.certs), Path(dcfg.keys)
    ca = _require(
        certs / "ca.crt",
        "the server's CA certificate",
        "copy ca.crt from the server's admin into deploy.certs",
    )
    key = _require(
        site_key_path(keys, site),
        f"site {site}'s private key",
        f"make it with python -m fedst.deploy key --out {keys} --site {site} and send "
        f"{site}_key.pub to the server's admin",
    )
    return [*command, "--root-certificates", str(ca), "--auth-supernode-private-key", str(key)]


def executor_command(dcfg: DeployConfig) -> list[str]:
    """The site's long-lived ClientApp process (fedst.app.site_executor) for the SuperNode's
    Runtime API on ``127.0.0.1:deploy.site_port``: one process for every message of the run, so
    imports and the site's model and data are built once, not once per message; it asks for a
    task every ``deploy.executor_poll`` seconds when idle."""
    address = f"127.0.0.1:{dcfg.site_port}"
    command = [sys.executable, "-m", "fedst.app.site_executor", "--runtime-api-address", address]
    return [*command, "--poll-seconds", str(dcfg.executor_poll)]


def stop_child(process: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM one process that shares our process group, SIGKILL it after ``grace`` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def check_site_data(cfg: ExperimentConfig, site: str) -> None:
    """Open the site's data before connecting, so a wrong folder is one clear line."""
    if site not in cfg.data.federation:
        raise DeploymentError(
            f"site={site} is not in data.federation {list(cfg.data.federation)}: pick one of them"
        )
    root = Path(cfg.data.sites[site].root)
    try:
        source = cfg.data.open(site)
        source.videos("train")
    except (OSError, ValueError, KeyError) as err:
        raise DeploymentError(
            f"site {site}: cannot read its data under {root} ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); set data.sites.{site}.root="
            f"<folder with the site's data>"
        ) from err


SUPERNODE_EXITING = "SuperNode terminated gracefully."
"""flower-supernode's last log line when it leaves (also when it lost its SuperLink)."""
EXIT_GRACE = 20.0
"""Seconds a SuperNode that logged its exit may take to end before it is stopped."""


def _tail(path: Path, offset: int) -> str:
    """The text of ``path`` from ``offset`` on ('' if absent)."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def serve_site(cfg: ExperimentConfig, site: str, dcfg: DeployConfig, progress: bool = False) -> int:
    """``train_fed.py site=A``: run the site's SuperNode until the server ends the federation.

    A SuperNode that crashed stays 'online' at the SuperLink for up to a minute (two missed
    heartbeats); restarting within that time is refused, so this retries until
    ``deploy.connect_timeout``. An unregistered key or an unreachable server is one line.

    Flower's SuperNode ends when the SuperLink it was connected to goes away (a restarted
    SuperLink does not know it). A site that was connected therefore starts a new SuperNode, and
    keeps trying for ``deploy.connect_timeout`` seconds: a restarted server (``train_fed.py
    site=server resume=<run dir>``) finds it again; if the server does not come back (the
    federation has ended, or the server is down), the site process ends with one line.
    """
    from fedst.training import prepare_data

    prepare_data(cfg, progress=progress)
    check_site_data(cfg, site)
    state_dir = Path(dcfg.state_dir).resolve()
    flwr_home = Path(dcfg.flwr_home or state_dir / "flwr" / site)
    env = process_env(flwr_home, dcfg)
    deadline = time.monotonic() + dcfg.connect_timeout
    connected_before = False
    log_path = state_dir / f"supernode_{site}.log"
    log.info("site %s: connecting to %s (log: %s)", site, dcfg.server, log_path)
    while True:
        offset = log_path.stat().st_size if log_path.exists() else 0
        wait = max(deadline - time.monotonic(), 5.0)  # the SuperNode's own reconnection window
        node = start(supernode_command(cfg, site, dcfg, progress, wait), log_path, env, False)
        executor = start(executor_command(dcfg), log_path, env, new_group=False)
        exiting_since = None
        try:
            while (code := node.poll()) is None:
                if exiting_since is None and SUPERNODE_EXITING in _tail(log_path, offset):
                    exiting_since = time.monotonic()
                elif exiting_since is not None and time.monotonic() - exiting_since > EXIT_GRACE:
                    # Flower's exit handlers can hang when two of its threads both raise
                    # SIGINT (seen when the SuperLink goes away): end it, as it meant to end
                    log.warning("site %s: the SuperNode did not finish exiting; stopping it", site)
                    stop_child(node, grace=5)
                    code = 0
                    break
                if executor.poll() is not None:  # state on disk: a new one resumes from it
                    log.warning(
                        "site %s: the ClientApp process exited with %d; starting a new one",
                        site,
                        executor.returncode,
                    )
                    executor = start(executor_command(dcfg), log_path, env, new_group=False)
                time.sleep(1.0)
        finally:
            stop_child(executor)
            if node.poll() is None:
                stop_child(node)
        output = log_path.read_text(errors="replace")[offset:]
        if code < 0:
            return code
        if CONNECTED in output:  # it was part of the federation until the server went away
            connected_before = True
            deadline = time.monotonic() + dcfg.connect_timeout
            log.warning(
                "site %s: lost the server at %s; reconnecting for up to %.0f s (a restarted "
                "server resumes the run; this site's state is on disk)",
                site,
                dcfg.server,
                dcfg.connect_timeout,
            )
            continue
        refused = "Failed to activate SuperNode" in output  # Flower exit code 305, printed
        if (refused or connected_before) and time.monotonic() < deadline:
            # not registered yet (the server registers keys after it starts), the server still
            # sees this site's previous SuperNode as online (up to two missed heartbeats), or a
            # server that is restarting
            log.info("site %s: the server does not accept this site yet; retrying in 5 s", site)
            time.sleep(5)
            continue
        if connected_before:
            log.info(
                "site %s: the server at %s has not come back for %.0f s (the federation has "
                "ended, or the server is down); stopping. The site's state stays in %s: start "
                "this command again to rejoin a resumed run",
                site,
                dcfg.server,
                dcfg.connect_timeout,
                state_dir,
            )
            return 0
        if refused:
            raise DeploymentError(
                f"the server at {dcfg.server} refused site {site}'s key "
                f"{site_key_path(Path(dcfg.keys), site)} for {dcfg.connect_timeout:.0f} s: it is "
                f"not registered; send {site}_key.pub to the server's admin (deploy.keys on the "
                f"server) and restart the server"
            )
        if code == EXIT_AUTH_FAILED or "connect" in output.lower():
            raise DeploymentError(
                f"site {site}: could not connect to the server at {dcfg.server} (exit {code}); "
                f"check deploy.server=<host:port>, that the server runs (python train_fed.py "
                f"site=server) and that deploy.certs has its ca.crt. Details: {log_path}"
            )
        if code == 0:
            return 0
        raise DeploymentError(f"site {site}: flower-supernode exited with {code}; see {log_path}")


# -- everything on one machine -------------------------------------------------------------------


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedst.deploy", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    local_help = "server + one process per site on 127.0.0.1, TLS and node authentication"
    run_local = commands.add_parser(
        "local", help=local_help, description=f"A whole deployment on this machine: {local_help}."
    )
    run_local.add_argument("--sites", nargs="+", default=["A", "B", "C", "D"])
    run_local.add_argument("--workdir", type=Path, default=None, help="default: a new temp dir")
    run_local.add_argument("overrides", nargs="*", help="train_fed.py overrides (experiment=tiny)")
    certs_help = "a throw-away CA and server certificate"
    certs = commands.add_parser(
        "certs", help=certs_help, description=f"TLS for a trial: {certs_help}."
    )
    certs.add_argument("--out", type=Path, required=True, help="folder for ca.crt, server.pem/key")
    certs.add_argument(
        "--hosts", nargs="+", default=["127.0.0.1", "localhost"], help="the server's names"
    )
    key_help = "a site's EC key pair (OpenSSH format)"
    key = commands.add_parser("key", help=key_help, description=f"Node authentication: {key_help}.")
    key.add_argument("--out", type=Path, required=True, help="folder for the key pair")
    key.add_argument("--site", required=True, help="the site the key belongs to")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.command == "certs":
        print(
            f"written: {make_certificates(args.out, args.hosts)}/{{ca.crt,server.pem,server.key}}"
        )
        return 0
    if args.command == "key":
        path = make_site_key(args.out, args.site)
        print(f"written: {path} (keep it at the site) and {path}.pub (send it to the server)")
        return 0
    with terminate_on_signal():
        return local(args.sites, args.overrides, args.workdir)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (DeploymentError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
