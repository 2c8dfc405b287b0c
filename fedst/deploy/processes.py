"""The processes of a deployment: their environment (one torch thread, no telemetry, this
checkout first on the path, the transfer settings of ``deploy.*``), starting one with its output in
a log file and in its own process group, stopping it with its children (SIGTERM, then SIGKILL),
free and open ports, and SIGTERM turned into SystemExit so that ``finally`` blocks stop the
children, the processes a child detached into sessions of their own (Flower's SuperLink starts
its SuperExec so) ended with it. :class:`DeploymentError` is the one-line error of every part of a
deployment."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from fedst.errors import UserError
from fedst.experiment import DeployConfig

log = logging.getLogger("fedst.deploy")  # the package's name, as before the split

APP_DIR = Path(__file__).resolve().parents[2]  # fedst/deploy/processes.py -> the checkout
"""The Flower app (pyproject.toml with [tool.flwr.app]) that ``flwr run`` bundles."""
BIN = Path(sys.executable).parent


class DeploymentError(UserError, RuntimeError):
    """A deployment problem with a one-line explanation that names the fix."""


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


class _Stat(NamedTuple):
    """What /proc/<pid>/stat says of a process."""

    parent: int
    group: int
    state: str
    started: int
    """Start time in clock ticks after boot: with the pid, it names one process."""


def _proc_stat(pid: int) -> _Stat | None:
    """/proc/<pid>/stat of process ``pid``; None when it is gone (or there is no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the name, which may hold spaces
    return _Stat(int(fields[1]), int(fields[2]), fields[0], int(fields[19]))


def _live_processes() -> Iterator[tuple[int, _Stat]]:
    """(pid, stat) of every process that has not exited (a zombie has: only its parent's wait
    is missing)."""
    for entry in Path("/proc").glob("[0-9]*"):
        stat = _proc_stat(int(entry.name))
        if stat is not None and stat.state != "Z":
            yield int(entry.name), stat


def detached_children(process: subprocess.Popen) -> list[tuple[int, int]]:
    """The live children of ``process`` that lead a session of their own, as (pid, start time):
    ``flower-superlink`` starts ``flower-superexec`` so (``start_new_session=True``,
    flwr/supercore/utils.py ``get_popen_detach_kwargs``), out of reach of :func:`stop`, and the
    SuperExec starts the ServerApp in its own process group. Empty where /proc is absent."""
    found = []
    for pid, stat in _live_processes():
        if stat.parent == process.pid and stat.group == pid:
            with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                if os.getsid(pid) == pid:
                    found.append((pid, stat.started))
    return found


def _group_alive(leader: int, started: int) -> bool:
    """Whether the process group of ``leader`` (the process that started at ``started``) still
    has a live member; the leader may have exited before the others."""
    stat = _proc_stat(leader)
    if stat is not None and stat.started != started:
        return False  # the pid is another process's now, so the group had emptied
    return any(member.group == leader for _, member in _live_processes())


def stop_detached(children: list[tuple[int, int]], grace: float = 10.0) -> None:
    """End the process groups of ``children`` (from :func:`detached_children`, taken before their
    parent was stopped): each group still running gets ``grace`` seconds to exit by itself,
    then SIGTERM and 5 s, then SIGKILL. Flower's SuperExec exits by itself once its SuperLink
    is gone (SIGTERM from the SuperLink, which waits only 1 s for it, or its parent poll every
    0.2 s, then Flower's 5 s force-exit bound), its ServerApp 0.5 s after it
    (fedst.app.site_executor.exit_with_parent); waiting for them here means that nothing of a
    stopped SuperLink outlives :func:`fedst.deploy.superlink`."""
    for leader, started in children:
        for signum, wait in ((None, grace), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if signum is not None:
                log.warning(
                    "process group %d outlived the process that started it: %s",
                    leader,
                    signum.name,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(leader, signum)
            deadline = time.monotonic() + wait
            while _group_alive(leader, started) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not _group_alive(leader, started):
                break


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


def stop_child(process: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM one process that shares our process group, SIGKILL it after ``grace`` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
