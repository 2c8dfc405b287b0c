"""A hospital's site (``train_fed.py site=A``): its data checked before it connects, its
``flower-supernode`` with the site's own node config and key, next to it one long-lived ClientApp
process (fedst.app.site_executor), and :func:`serve_site`, which keeps them running until the
server ends the federation: it retries while the server does not accept the site yet, reconnects
after losing a server that may come back, and ends a SuperNode stuck in its exit."""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import time
from pathlib import Path

from fedst.app.nodes import site_node_config
from fedst.deploy.credentials import require_file, site_key_path
from fedst.deploy.processes import BIN, DeploymentError, process_env, start, stop_child
from fedst.experiment import DeployConfig, ExperimentConfig

log = logging.getLogger("fedst.deploy")  # the package's name, as before the split


CONNECTED = "SuperNode ID:"
"""What flower-supernode logs once the SuperLink has activated it."""

EXIT_AUTH_FAILED = 305
"""flower-supernode's exit code when the SuperLink refuses to activate it."""


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
        frame_cache=None if node.frame_cache is None else str(Path(node.frame_cache).resolve()),
    )
    command = [str(BIN / "flower-supernode"), "--superlink", dcfg.server]
    command += ["--host", "127.0.0.1", "--port", str(dcfg.site_port)]
    command += ["--isolation", "process", "--node-config", node.to_cli()]
    command += ["--max-wait-time", str(dcfg.connect_timeout if max_wait is None else max_wait)]
    if dcfg.insecure:
        return [*command, "--insecure"]
    certs, keys = Path(dcfg.certs), Path(dcfg.keys)
    ca = require_file(
        certs / "ca.crt",
        "the server's CA certificate",
        "copy ca.crt from the server's admin into deploy.certs",
    )
    key = require_file(
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


def check_site_data(cfg: ExperimentConfig, site: str) -> float:
    """Open and validate the site's data before it connects, as its first message would
    (fedst.scoring.site_data.open_party_data: every labelled frame, clip frame and label of
    its training split and of the test splits it is scored on, decoded in full; results cached
    by path, size and mtime, fedst.data.validation), so that a wrong folder or a bad file is one
    clear line here, not a failed round 1, and round 1 never spends ``deploy.round_timeout``
    validating 1080p frames. Returns the seconds it took (logged)."""
    from fedst.data.base import DataError
    from fedst.methods import method_of
    from fedst.scoring.site_data import open_party_data

    if site not in cfg.data.federation:
        raise DeploymentError(
            f"site={site} is not in data.federation {list(cfg.data.federation)}: pick one of them"
        )
    root = Path(cfg.data.sites[site].root)
    started = time.perf_counter()
    try:
        source = cfg.data.open(site)
        source.videos("train")
    except (OSError, ValueError, KeyError) as err:
        raise DeploymentError(
            f"site {site}: cannot read its data under {root} ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); set data.sites.{site}.root="
            f"<folder with the site's data>"
        ) from err
    log.info("site %s: validating its data under %s before connecting", site, root)
    try:
        data = open_party_data(cfg, method_of(cfg), site)
    except (DataError, OSError, ValueError) as err:
        lines = str(err).splitlines() or [type(err).__name__]
        if len(lines) > 1:
            log.warning("site %s: data problems:\n%s", site, "\n".join(lines[1:]))
        raise DeploymentError(
            f"site {site}: its data under {root} did not validate ({lines[0].rstrip(':')}"
            f"{f'; {len(lines) - 1} more line(s) in the log above' if len(lines) > 1 else ''}); "
            f"fix those files (python -m fedst.data.check site={site} lists them) or set "
            f"data.sites.{site}.root=<folder with the site's data>"
        ) from err
    seconds = time.perf_counter() - started
    log.info(
        "site %s: data validated in %.1f s (%d training samples, test splits of %s)",
        site,
        seconds,
        len(data.train),
        ", ".join(data.tests),
    )
    return seconds


SUPERNODE_EXITING = "SuperNode terminated gracefully."
"""flower-supernode's last log line when it leaves (also when it lost its SuperLink)."""

EXIT_GRACE = 20.0
"""Seconds a SuperNode that logged its exit may take to end before it is stopped."""

SIGNAL_ENDS = 3
"""SuperNodes in a row that may end by a signal before the site process stops with one line."""


def ended_by(code: int) -> str:
    """How a process with exit status ``code`` ended: 'exit <code>', or the signal that ended it
    (a negative status, as :class:`subprocess.Popen` reports it)."""
    if code >= 0:
        return f"exit {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


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

    How the SuperNode ended does not matter: a restarted SuperLink refuses both of its threads
    (the Fleet loop and the heartbeat), and each then sends SIGINT to its own process
    (flwr/supercore/retry/http_retry.py ``_should_giveup``, flwr/supernode/
    fleet_http_connection.py ``send_node_heartbeat``). Flower's handler takes the first and puts
    back the default one, so a second that lands while the first exit is still running (longer
    on a loaded machine) ends the SuperNode by SIGINT. Signals this function sends itself never
    reach this point, and a site process that is asked to stop leaves through its own
    ``finally``; a SuperNode that ends by a signal is restarted like any other, up to
    ``SIGNAL_ENDS`` times in a row.
    """
    from fedst.training import prepare_data

    prepare_data(cfg, progress=progress)
    check_site_data(cfg, site)
    state_dir = Path(dcfg.state_dir).resolve()
    flwr_home = Path(dcfg.flwr_home or state_dir / "flwr" / site)
    env = process_env(flwr_home, dcfg)
    deadline = time.monotonic() + dcfg.connect_timeout
    connected_before = False
    signal_ends = 0  # SuperNodes in a row that ended by a signal
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
        signal_ends = signal_ends + 1 if code < 0 else 0
        if signal_ends > SIGNAL_ENDS:
            raise DeploymentError(
                f"site {site}: {signal_ends} SuperNodes in a row ended by a signal (the last by "
                f"{ended_by(code)}); see {log_path}"
            )
        if CONNECTED in output:  # it was part of the federation until the server went away
            connected_before = True
            deadline = time.monotonic() + dcfg.connect_timeout
            log.warning(
                "site %s: lost the server at %s (the SuperNode ended with %s); reconnecting for "
                "up to %.0f s (a restarted server resumes the run; this site's state is on disk)",
                site,
                dcfg.server,
                ended_by(code),
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
                f"site {site}: could not connect to the server at {dcfg.server} "
                f"({ended_by(code)}); "
                f"check deploy.server=<host:port>, that the server runs (python train_fed.py "
                f"site=server) and that deploy.certs has its ca.crt. Details: {log_path}"
            )
        if code == 0:
            return 0
        raise DeploymentError(
            f"site {site}: flower-supernode ended with {ended_by(code)}; see {log_path}"
        )
