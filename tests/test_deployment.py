# Over 600 lines: the loopback deployment's scenarios share one module fixture (the tiny benchmark,
# generated once) and the Loopback helper that starts and stops SuperLink and SuperNodes.
"""Loopback deployment: SuperLink and SuperNodes as separate processes on 127.0.0.1, with TLS and
SuperNode authentication, through the real entry points (``train_fed.py site=server`` and
``train_fed.py site=<name>``).

Every process is started in its own process group with OMP_NUM_THREADS=1 (fedst.deploy.start)
and stopped at the end, also on failure; each wait has a hard timeout. Each site runs one
ClientApp process (fedst.app.site_executor), but Flower's message transport still costs tens of
seconds per round here, so the default test is kept to two sites and two rounds; the scenarios
of several minutes (a site killed during a round, a server killed and resumed, ``flwr run`` with
an empty run-dir) are marked ``slow``: ``make test-slow`` (``pytest -m slow``) runs them, and CI
runs it after ``make test``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedst import deploy
from fedst.config import ConfigError
from fedst.data.procedural import generate
from fedst.deploy.processes import _proc_stat
from fedst.experiment import DeployConfig, Runtime
from fedst.methods import method_of
from fedst.training import run_training
from tests.test_federation import experiment, read_jsonl

REPO = Path(__file__).resolve().parents[1]
SERVER_TIMEOUT = 600  # s: the whole federation, a hard bound


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


class Loopback:
    """Certificates, keys and processes of one loopback federation under ``work``."""

    def __init__(self, work: Path, root: Path, sites: list[str], overrides: list[str]) -> None:
        self.work, self.sites = work, sites
        self.certs = deploy.make_certificates(work / "certs")
        self.keys = work / "keys"
        for site in sites:
            deploy.make_site_key(self.keys, site)
        self.port = deploy.free_port()
        self.common = [
            "experiment=tiny",
            f"data.root={root}",
            f"data.federation=[{','.join(sites)}]",
            f"deploy.certs={self.certs}",
            f"deploy.keys={self.keys}",
            "progress=false",
            *overrides,
        ]
        self.run_dir = work / "run"
        self.processes: dict[str, subprocess.Popen] = {}

    def start_server(self, *extra: str) -> subprocess.Popen:
        command = [sys.executable, str(REPO / "train_fed.py"), "site=server"]
        command += ["deploy.host=127.0.0.1", f"deploy.port={self.port}"]
        command += [f"hydra.run.dir={self.run_dir}", "deploy.audit=true", *self.common, *extra]
        return self._start("server", command)

    def restart_server(self, name: str = "server_resumed") -> subprocess.Popen:
        """``train_fed.py site=server resume=<run dir>`` on the same port: the restarted server
        takes the run's own config from the run directory; only deploy.* and runtime keys are
        given on its command line."""
        command = [sys.executable, str(REPO / "train_fed.py"), "site=server"]
        command += [f"resume={self.run_dir}", "deploy.host=127.0.0.1", f"deploy.port={self.port}"]
        command += [f"deploy.certs={self.certs}", f"deploy.keys={self.keys}", "deploy.audit=true"]
        command += ["progress=false", f"hydra.run.dir={self.work / 'hydra' / name}"]
        return self._start(name, command)

    def start_site(
        self,
        site: str,
        *extra: str,
        name: str | None = None,
        state: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """``train_fed.py site=<site>`` as process ``name``, with state folder ``state``
        (default: ``name``) and environment ``env`` (default: deploy.process_env())."""
        command = [sys.executable, str(REPO / "train_fed.py"), f"site={site}"]
        command += [
            f"deploy.server=127.0.0.1:{self.port}",
            f"deploy.site_port={deploy.free_port()}",
        ]
        command += [f"deploy.state_dir={self.state_dir(state or name or site)}"]
        command += [f"hydra.run.dir={self.work / 'hydra' / (name or site)}", *self.common, *extra]
        return self._start(name or site, command, env)

    def state_dir(self, name: str) -> Path:
        """The state folder of the site process ``name`` (a site, or a test's extra process)."""
        return self.work / "sites" / name

    def _start(
        self, name: str, command: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        process = deploy.start(command, self.work / f"{name}.out", env or deploy.process_env())
        self.processes[name] = process
        return process

    def output(self, name: str) -> str:
        return (self.work / f"{name}.out").read_text(errors="replace")

    def stop_all(self) -> None:
        for process in self.processes.values():
            deploy.stop(process, grace=5)


def leftover_processes(marker: str) -> list[str]:
    """Command lines of live processes whose environment or command line mentions ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            blob = (proc / "environ").read_bytes() + (proc / "cmdline").read_bytes()
            if marker.encode() in blob and (proc / "stat").read_text().split()[2] != "Z":
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def test_stop_ends_a_process_in_its_own_group_and_one_that_shares_ours(tmp_path):
    env = deploy.process_env()
    own = deploy.start(["sleep", "60"], tmp_path / "own.log", env)
    shared = deploy.start(["sleep", "60"], tmp_path / "shared.log", env, new_group=False)
    deploy.stop(own, grace=2)
    deploy.stop(shared, grace=2)
    assert own.poll() is not None and shared.poll() is not None


def test_nothing_a_superlink_started_in_a_session_of_its_own_outlives_deploy_superlink(
    tmp_path, monkeypatch
):
    """A stand-in SuperLink opens its port after starting a child in a session of its own, as
    Flower's SuperLink starts flower-superexec: the child exits once its parent is gone (as the
    SuperExec does, up to seconds later) but leaves its own child behind in its process group
    (as a ServerApp may be for a moment). When ``deploy.running_superlink`` has returned, none is
    alive."""
    grandchild = "import time; time.sleep(60)"
    child = (
        "import os, subprocess, sys, time\n"
        "parent = os.getppid()\n"
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        "while os.getppid() == parent:\n"
        "    time.sleep(0.1)\n"
    )
    fake = (
        "import socket, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)\n"
        "server = socket.socket()\n"
        "server.bind(('127.0.0.1', int(sys.argv[1])))\n"
        "server.listen()\n"
        "time.sleep(60)\n"
    )
    port = deploy.free_port()
    command = [sys.executable, "-c", fake, str(port)]
    monkeypatch.setattr(deploy.superlink, "superlink_command", lambda *args: command)
    monkeypatch.setattr(deploy.superlink, "SUPEREXEC_EXIT", 1.0)
    dcfg = DeployConfig(host="127.0.0.1", port=port, insecure=True)
    # FLWR_HOME under tmp_path: in every environment
    with deploy.running_superlink([], dcfg, tmp_path):
        deadline = time.monotonic() + 30
        while len(running := leftover_processes(str(tmp_path))) < 3:
            assert time.monotonic() < deadline, running
            time.sleep(0.1)
    assert f"{sys.executable} -c {grandchild} " in running, running
    assert leftover_processes(str(tmp_path)) == []


def test_a_site_ends_a_supernode_stuck_in_its_exit_and_stops_when_the_server_stays_away(
    tiny_root, tmp_path, monkeypatch
):
    """A stand-in SuperNode that connects, logs its exit and then hangs (as Flower's did once
    its SuperLink was killed) is stopped; the site starts a new one, which cannot connect, and
    the site process ends by itself once the server has stayed away for deploy.connect_timeout."""
    starts = tmp_path / "starts"
    fake = (
        "import pathlib, sys, time\n"
        f"starts = pathlib.Path({str(starts)!r})\n"
        "starts.write_text(starts.read_text() + 'x' if starts.exists() else 'x')\n"
        "if len(starts.read_text()) == 1:\n"
        f"    print({deploy.CONNECTED!r} + ' 1', flush=True)\n"
        f"    print({deploy.SUPERNODE_EXITING!r}, flush=True)\n"
        "    time.sleep(600)\n"
        "print('Failed to initialize the connection to the SuperLink.', flush=True)\n"
        "sys.exit(1)\n"
    )
    monkeypatch.setattr(
        deploy.supernode, "supernode_command", lambda *a, **k: [sys.executable, "-c", fake]
    )
    monkeypatch.setattr(deploy.supernode, "executor_command", lambda dcfg: ["sleep", "600"])
    monkeypatch.setattr(deploy.supernode, "EXIT_GRACE", 1.0)
    dcfg = DeployConfig(state_dir=str(tmp_path / "state"), connect_timeout=8.0)
    started = time.monotonic()
    assert deploy.serve_site(experiment(tiny_root), "A", dcfg) == 0
    assert time.monotonic() - started < 60
    assert len(starts.read_text()) >= 2  # the stuck one was stopped and a new one started
    assert leftover_processes(str(starts)) == []


def stand_in_supernode(starts: Path, first: str, later: str) -> str:
    """A ``python -c`` stand-in for flower-supernode: it counts its starts in ``starts``; the
    first logs that it connected, then runs ``first``; every later one runs ``later``."""
    return (
        "import os, pathlib, signal, sys, time\n"
        f"starts = pathlib.Path({str(starts)!r})\n"
        "starts.write_text(starts.read_text() + 'x' if starts.exists() else 'x')\n"
        "if len(starts.read_text()) == 1:\n"
        f"    print({deploy.CONNECTED!r} + ' 1', flush=True)\n"
        f"    {first}\n"
        f"{later}\n"
    )


SERVER_AWAY = (
    "print('Failed to initialize the connection to the SuperLink.', flush=True); sys.exit(1)"
)
"""What a stand-in SuperNode does when the server does not come back."""

ENDED_BY_SIGINT = (
    f"print({deploy.SUPERNODE_EXITING!r}, flush=True); signal.signal(signal.SIGINT, "
    "signal.SIG_DFL); os.kill(os.getpid(), signal.SIGINT); time.sleep(60)"
)
"""How Flower's SuperNode ends when a restarted SuperLink refuses both its Fleet loop and its
heartbeat: each sends SIGINT to its own process, Flower's handler takes the first and puts back
the default one, and the second ends the process by SIGINT (exit status -2)."""


def test_a_site_reconnects_when_its_supernode_ends_by_sigint_after_a_server_restart(
    tiny_root, tmp_path, monkeypatch
):
    """The race of a server restart under load, made deterministic: the connected SuperNode ends
    by SIGINT, as Flower's does when the second of its two SIGINTs lands during the exit of the
    first. The site starts a new SuperNode (it used to return the -2 and end without a word, so
    the resumed server waited for it in vain); that one cannot connect, and the site process
    ends by itself once the server has stayed away for deploy.connect_timeout."""
    starts = tmp_path / "starts"
    fake = stand_in_supernode(starts, ENDED_BY_SIGINT, SERVER_AWAY)
    monkeypatch.setattr(
        deploy.supernode, "supernode_command", lambda *a, **k: [sys.executable, "-c", fake]
    )
    monkeypatch.setattr(deploy.supernode, "executor_command", lambda dcfg: ["sleep", "600"])
    dcfg = DeployConfig(state_dir=str(tmp_path / "state"), connect_timeout=6.0)
    assert deploy.serve_site(experiment(tiny_root), "A", dcfg) == 0
    assert len(starts.read_text()) >= 2  # a new SuperNode after the one that ended by SIGINT
    assert leftover_processes(str(starts)) == []


def test_a_site_whose_supernodes_keep_ending_by_a_signal_stops_with_one_line_naming_it(
    tiny_root, tmp_path, monkeypatch
):
    """Restarting is bounded: a SuperNode that ends by a signal each time it has connected (an
    out-of-memory kill, say) is restarted deploy.SIGNAL_ENDS times, then the site process stops
    with one line naming the site and the signal."""
    starts = tmp_path / "starts"
    killed = "os.kill(os.getpid(), signal.SIGKILL)"
    fake = stand_in_supernode(starts, killed, f"print({deploy.CONNECTED!r} + ' 2'); {killed}")
    monkeypatch.setattr(
        deploy.supernode, "supernode_command", lambda *a, **k: [sys.executable, "-c", fake]
    )
    monkeypatch.setattr(deploy.supernode, "executor_command", lambda dcfg: ["sleep", "600"])
    dcfg = DeployConfig(state_dir=str(tmp_path / "state"), connect_timeout=60.0)
    with pytest.raises(deploy.DeploymentError) as stopped:
        deploy.serve_site(experiment(tiny_root), "A", dcfg)
    assert str(stopped.value).startswith(
        "site A: 4 SuperNodes in a row ended by a signal (the last by SIGKILL); see "
    )
    assert len(starts.read_text()) == deploy.SIGNAL_ENDS + 1
    assert leftover_processes(str(starts)) == []


def supernode_pids(marker: str) -> list[int]:
    """Pids of the live flower-supernode processes whose environment mentions ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or (proc / "stat").read_text().split()[2] == "Z":
                continue
            program = (proc / "cmdline").read_bytes().split(b"\0")[:2]  # a script: python, path
            if any(part.endswith(b"flower-supernode") for part in program) and (
                marker.encode() in (proc / "environ").read_bytes()
            ):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def send_sigint_until_gone(pid: int, every_s: float = 0.1, at_most: int = 100) -> None:
    """SIGINT to ``pid``, then again every ``every_s`` seconds while it lives: a later one lands
    during the exit the first began, as the second of Flower's two does. (Two signals sent before
    the process runs its Python handler merge into one, under load by chance; a process then
    ending cleanly by that one handler would not test the second.)"""
    for _ in range(at_most):
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            return
        time.sleep(every_s)
        stat = _proc_stat(pid)
        if stat is None or stat.state == "Z":  # gone, or exited and not yet waited for
            return


@pytest.mark.slow
def test_a_site_reconnects_when_flowers_supernode_ends_by_its_two_sigints(tiny_root, tmp_path):
    """Flower's own SuperNode, connected to a SuperLink with TLS and authentication, gets the two
    SIGINTs its two threads send when a restarted SuperLink refuses both its Fleet loop and its
    heartbeat, the second during the exit of the first (here: SIGINT every 0.1 s until it is
    gone, send_sigint_until_gone). It ends by SIGINT, and the site process starts a new SuperNode that connects again
    (before the fix the site process ended without a word)."""
    loop = Loopback(tmp_path / "loop", tiny_root, ["A"], [])
    dcfg = DeployConfig(
        host="127.0.0.1", port=loop.port, certs=str(loop.certs), keys=str(loop.keys)
    )
    supernode_log = loop.state_dir("A") / "supernode_A.log"

    def connections() -> int:
        return supernode_log.read_text().count(deploy.CONNECTED) if supernode_log.exists() else 0

    try:
        with deploy.running_superlink(["A"], dcfg, tmp_path / "server"):
            site = loop.start_site("A", "deploy.connect_timeout=120")
            deadline = time.monotonic() + 240
            while connections() < 1:
                assert time.monotonic() < deadline and site.poll() is None, loop.output("A")
                time.sleep(0.5)
            (supernode,) = supernode_pids(str(loop.state_dir("A")))
            send_sigint_until_gone(supernode)
            while connections() < 2:
                assert time.monotonic() < deadline and site.poll() is None, loop.output("A")
                time.sleep(0.5)
    finally:
        loop.stop_all()
    # Flower's handler may take the last SIGINT and exit 0 (timing): either ending reconnects; the
    # exit by SIGINT itself is pinned by the stand-in SuperNode's test above
    assert re.search(
        r"\(the SuperNode ended with (SIGINT|exit 0)\); reconnecting", loop.output("A")
    )
    assert leftover_processes(str(tmp_path / "loop")) == []


def wire_rows(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "wire.jsonl")


def test_missing_certificates_and_unreadable_data_are_one_line_naming_the_fix(tiny_root, tmp_path):
    cfg = experiment(tiny_root)
    missing = DeployConfig(certs=str(tmp_path / "none"), keys=str(tmp_path / "none"))
    with pytest.raises(deploy.DeploymentError, match=r"ca\.crt is missing: copy ca\.crt"):
        deploy.supernode_command(cfg, "A", missing)
    with pytest.raises(deploy.DeploymentError, match=r"TLS file .*server\.pem|ca\.crt is missing"):
        deploy.serve(cfg, tmp_path / "run", missing)
    elsewhere = experiment(tiny_root, f"data.sites.A.root={tmp_path / 'nowhere'}")
    with pytest.raises(deploy.DeploymentError, match=r"set data\.sites\.A\.root="):
        deploy.check_site_data(elsewhere, "A")


def test_each_setup_mistake_ends_train_fed_with_one_error_line_naming_the_fix(
    tiny_root, tmp_path, caplog, monkeypatch
):
    """``train_fed.py site=...`` (its ``deploy`` function, in-process): exit code 2 and exactly
    one ERROR line, no exception, for a missing certificate (site and server), a missing site
    key and a data folder that cannot be read. (A wrong server address and an unregistered key
    need a SuperLink: the loopback test checks them through the same function.)"""
    import train_fed
    from fedst.cli import compose_experiment

    monkeypatch.setattr(train_fed, "setup_logging", lambda *args: None)  # keep pytest's capture
    certs = deploy.make_certificates(tmp_path / "certs")
    tiny = experiment(tiny_root)
    unreadable, _ = compose_experiment(["data=paper", f"data.sites.A.root={tmp_path / 'nowhere'}"])
    # the server of a trial has none of the hospitals' data (and needs none here: no synthetic
    # pre-training or SERQ set, no out-of-federation site)
    trial, _ = compose_experiment(
        [
            "data=paper",
            "method=fedavg",
            "method.synthetic_pretraining=false",
            "data.federation=[A,B]",
            "data.out_of_federation=[]",
        ]
    )
    cases = [
        (tiny, "A", {"certs": str(tmp_path / "none")}, r"ca\.crt is missing: copy ca\.crt"),
        (trial, "server", {"certs": str(tmp_path / "none")}, r"TLS file .* make certificates"),
        (tiny, "A", {"certs": str(certs), "keys": str(tmp_path / "none")}, r"fedst\.deploy key"),
        (unreadable, "A", {"certs": str(certs)}, r"set data\.sites\.A\.root=<folder"),
    ]
    for cfg, site, options, fix in cases:
        caplog.clear()
        runtime = Runtime(site=site, progress=False, deploy=DeployConfig(**options))
        with caplog.at_level(logging.INFO):
            assert train_fed.deploy(cfg, tmp_path / "run", runtime) == 2, (site, options)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and re.search(fix, errors[0]), (site, options, errors)
        assert "\n" not in errors[0]


def test_the_deployed_server_validates_the_data_it_reads_not_the_hospitals(tmp_path):
    from fedst.cli import compose_experiment
    from fedst.data.base import DataError
    from fedst.training import prepare_run

    overrides = ["data=paper", "method=fedavg", "data.federation=[A,B]"]
    overrides.append("method.synthetic_pretraining=false")  # the server needs no synthetic set
    overrides.append(f"data.root={tmp_path / 'empty'}")  # no site's data anywhere
    server_only, _ = compose_experiment([*overrides, "data.out_of_federation=[]"])
    prepare_run(server_only, tmp_path / "run", federated_data=False)  # nothing the server reads
    with pytest.raises(DataError, match=r"site 'A'"):  # the in-process engine reads them all
        prepare_run(server_only, tmp_path / "run")
    evaluated_here, _ = compose_experiment([*overrides, "data.out_of_federation=[E]"])
    with pytest.raises(DataError, match=r"site 'E'") as caught:  # the server evaluates E itself
        prepare_run(evaluated_here, tmp_path / "run", federated_data=False)
    assert "site 'A'" not in str(caught.value)
    pretrained, _ = compose_experiment([o for o in overrides if "synthetic_pretraining" not in o])
    with pytest.raises(DataError, match=r"site 'synthetic'"):  # the server pre-trains on it
        prepare_run(pretrained, tmp_path / "run", federated_data=False)


def test_the_latency_settings_reach_the_flower_processes_the_executor_and_the_serverapp():
    """deploy.transfers_in_flight / chunk_mib become the environment Flower reads at import
    (flwr/supercore/constant.py, flwr/common/constant.py), deploy.executor_poll the executor's
    pause, deploy.reply_poll the deployed ServerApp's (through flwr run's run config)."""
    dcfg = DeployConfig(transfers_in_flight=8, chunk_mib=2.5, executor_poll=0.3, reply_poll=0.7)
    env = deploy.process_env(None, dcfg)
    assert env["FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES"] == "8"
    assert env["FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS"] == "8"
    assert env["FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE"] == str(int(2.5 * 2**20))
    command = deploy.executor_command(dcfg)
    assert command[command.index("--poll-seconds") + 1] == "0.3"
    overrides = deploy.run_config_overrides(Path("run"), dcfg)
    assert "reply-poll=0.7" in overrides.split()
    with pytest.raises(ConfigError, match=r"deploy.chunk_mib=0: must be > 0"):
        DeployConfig(chunk_mib=0)
    with pytest.raises(ConfigError, match=r"deploy.transfers_in_flight=0: must be >= 1"):
        DeployConfig(transfers_in_flight=0)


def test_loopback_deployment_with_tls_and_auth_matches_the_in_process_engine(tiny_root, tmp_path):
    """Device: train.device=auto (CUDA where present) with the tiny experiment's
    train.deterministic=true, so the match holds bit for bit on the CPU and on one GPU."""
    overrides = ["train.eval_every=2", "data.out_of_federation=[E]"]
    loop = Loopback(tmp_path / "loop", tiny_root, ["A", "D"], overrides)
    deploy.make_site_key(tmp_path / "rogue", "A")  # a key the server never registered
    started = time.monotonic()
    try:
        server = loop.start_server()
        for site in loop.sites:
            loop.start_site(site)
        rogue = loop.start_site(
            "A",
            f"deploy.keys={tmp_path / 'rogue'}",
            "deploy.connect_timeout=20",
            name="rogue",
        )
        lost = loop.start_site(
            "D", "deploy.server=127.0.0.1:1", "deploy.connect_timeout=10", name="lost"
        )
        assert rogue.wait(timeout=240) == 2 and lost.wait(timeout=240) == 2
        assert server.wait(timeout=SERVER_TIMEOUT) == 0, loop.output("server")[-3000:]
    finally:
        loop.stop_all()
    wall = time.monotonic() - started
    assert leftover_processes(str(tmp_path / "loop")) == []

    # each site ran all its messages (the statistics query, 2 train, evaluate, query.personal)
    # in one ClientApp process
    for site in loop.sites:
        text = (loop.state_dir(site) / f"supernode_{site}.log").read_text(errors="replace")
        assert text.count("ClientApp executor (pid") == 1, site
        assert text.count("message: pulled from the SuperNode") == 5, text[-2000:]

    # the unregistered SuperNode was refused, with one line naming the fix
    errors = [line for line in loop.output("rogue").splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "refused site A's key" in errors[0], loop.output("rogue")[-2000:]
    assert "Traceback" not in loop.output("rogue")
    # so was a SuperNode given a wrong server address
    errors = [line for line in loop.output("lost").splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "could not connect to the server at 127.0.0.1:1" in errors[0]
    assert "check deploy.server=<host:port>" in errors[0]

    # same seed, same results as the in-process engine: bit-identical (the replies are
    # aggregated in federation order, every site restores its state from disk exactly)
    cfg = experiment(tiny_root, *overrides, "data.federation=[A,D]")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in every deployed process (OMP_NUM_THREADS=1): same float sums
    try:
        inprocess = run_training(cfg, tmp_path / "inprocess", progress=False)
    finally:
        torch.set_num_threads(threads)
    deployed = json.loads((loop.run_dir / "final.json").read_text())
    assert deployed["sites"] == inprocess["sites"]
    assert deployed["out_of_federation"] == inprocess["out_of_federation"]
    losses = {
        name: sorted((r["round"], r["site"], r.get("loss")) for r in read_jsonl(d / "train.jsonl"))
        for name, d in (("deployed", loop.run_dir), ("inprocess", tmp_path / "inprocess"))
    }
    assert losses["deployed"] == losses["inprocess"]
    for site in ("A", "D"):
        at_site = torch.load(loop.state_dir(site) / "run" / "state_r0002.pt", weights_only=False)
        local = torch.load(
            tmp_path / "inprocess" / "sites" / site / "state_r0002.pt", weights_only=False
        )
        for key, value in local["personal"].items():
            assert torch.equal(at_site["personal"][key], value), (site, key)
        # the returned v_k's gamma_k^T, kept by the server from the last train reply
        exported = torch.load(loop.run_dir / "sites" / site / "state_r0002.pt", weights_only=False)
        assert set(exported["shared"]) == set(local["shared"])
        for key, value in local["shared"].items():
            assert torch.equal(exported["shared"][key], value), (site, key)

    # what crossed the wire: during training no personalized key and nothing image-shaped, and
    # no path in any config; rho_k only in the final, logged export the sites allowed
    partition = method_of(cfg).partition(method_of(cfg).build_model())
    personal = set(partition.personal)
    height, width = cfg.clip.image_size
    rows = wire_rows(loop.run_dir)
    assert {(r["direction"], r["type"]) for r in rows} >= {("up", "train"), ("up", "evaluate")}
    for row in rows:
        for name, record in row.get("arrays", {}).items():
            assert all(tuple(shape[-2:]) != (height, width) for shape in record.values())
            if row["direction"] == "up" and row["type"] in ("train", "evaluate"):
                assert not set(record) & personal, (row["type"], name)
            if row["type"] == "query.personal" and row["direction"] == "up":
                assert name == "personal" and set(record) == personal
        text = json.dumps(row.get("config_values", {}))
        assert str(tiny_root) not in text and str(tmp_path) not in text
    assert "sent its personalized parameters" in (loop.run_dir / "log.txt").read_text()
    print(f"loopback wall time: {wall:.0f} s")


@pytest.mark.slow
def test_a_site_killed_during_a_round_is_left_out_and_rejoins_with_its_saved_state(
    tiny_root, tmp_path
):
    """Four sites, three rounds; site D's processes are SIGKILLed while round 2 trains."""
    overrides = ["train.total_iters=6", "data.out_of_federation=[]"]
    loop = Loopback(tmp_path / "loop", tiny_root, ["A", "B", "C", "D"], overrides)
    try:
        server = loop.start_server("deploy.min_sites=3", "deploy.round_timeout=150")
        for site in loop.sites:
            loop.start_site(site)
        state_d = loop.state_dir("D") / "run"
        supernode_log = loop.state_dir("D") / "supernode_D.log"
        deadline = time.monotonic() + SERVER_TIMEOUT
        while not (supernode_log.exists() and "ROUND 2]" in supernode_log.read_text()):
            assert time.monotonic() < deadline and server.poll() is None  # D received round 2
            time.sleep(1)
        os.killpg(loop.processes["D"].pid, signal.SIGKILL)  # D's SuperNode and ClientApp
        loop.processes["D"].wait(30)
        saved = torch.load(state_d / "state_r0001.pt", weights_only=False)["personal"]
        loop.start_site("D", "deploy.connect_timeout=300", name="D_again", state="D")
        assert server.wait(timeout=SERVER_TIMEOUT) == 0, loop.output("server")[-3000:]
    finally:
        loop.stop_all()
    assert leftover_processes(str(tmp_path / "loop")) == []
    participation = read_jsonl(loop.run_dir / "participation.jsonl")
    assert participation[1]["missing"] == ["D"] and participation[2]["missing"] == []
    state_3 = torch.load(state_d / "state_r0003.pt", weights_only=False)
    steps = {int(s["step"]) for s in state_3["optimizer"]["state"].values()}
    # D continued from its own saved optimizer and rho_k: rounds 1 and 3 (2 local iterations
    # each), or 1, 2 and 3 if its restarted SuperNode still got the (expired-later) round-2
    # message; a fresh start would have 2
    assert steps in ({4}, {6})
    assert saved  # D had saved round 1 before it was killed


OLD_ROUND_SITE = '''"""Test only (tests/test_deployment.py): in this process, the FedST ClientApp
answers round 2's train message as if it answered round 1 (issue 45's 'answers an old round')."""
import importlib.machinery
import sys


class OldRound:
    def find_spec(self, name, path, target=None):
        if name != "fedst.app.client_app":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            record = module._site_record

            def stale(site, config, **extra):
                answer = record(site, config, **extra)
                if "data-size" in extra and int(config["server-round"]) == 2:
                    answer["round"] = 1
                return answer

            module._site_record = stale

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, OldRound())
'''


@pytest.mark.slow
def test_a_deployed_site_answering_an_old_round_is_left_out_and_named(tiny_root, tmp_path):
    """Three sites, two rounds, SERQ off (gamma_g is the plain mean); D's processes get a
    sitecustomize that makes its ClientApp answer round 2 as round 1. The server refuses D's
    reply (round check), goes on with A and B (deploy.min_sites=2): gamma_g after round 2 is the
    mean of A's and B's gamma_k as they saved them, and the logs name D and the check."""
    overrides = ["method.serq=false", "data.out_of_federation=[]"]
    loop = Loopback(tmp_path / "loop", tiny_root, ["A", "B", "D"], overrides)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(OLD_ROUND_SITE)
    faulty = deploy.process_env()
    faulty["PYTHONPATH"] = os.pathsep.join([str(hook), faulty["PYTHONPATH"]])
    try:
        server = loop.start_server("deploy.min_sites=2")
        for site in loop.sites:
            loop.start_site(site, env=faulty if site == "D" else None)
        assert server.wait(timeout=SERVER_TIMEOUT) == 0, loop.output("server")[-3000:]
    finally:
        loop.stop_all()
    assert leftover_processes(str(tmp_path / "loop")) == []
    refused = [r for r in read_jsonl(loop.run_dir / "train.jsonl") if "refused" in r]
    assert [(r["round"], r["site"], r["step"], r["refused"]) for r in refused] == [
        (2, "D", "train", "round")
    ]
    assert refused[0]["reason"] == "it answers round 1, the step asked round 2"
    wire = [r for r in read_jsonl(loop.run_dir / "wire.jsonl") if "refused" in r]
    assert [(r["round"], r["site"], r["refused"]) for r in wire] == [(2, "D", "round")]
    participation = read_jsonl(loop.run_dir / "participation.jsonl")
    assert [r["missing"] for r in participation] == [[], ["D"]]
    final = json.loads((loop.run_dir / "final.json").read_text())
    assert final["refused_replies"]["by_check"] == {"round": 1}
    assert "refused the reply of site D (round check)" in (loop.run_dir / "log.txt").read_text()
    # the server's gamma_g of round 2 (no server step) is the mean of A's and B's replies, which
    # are their own gamma_k^2 on disk (fp32 transport); D's, on its disk too, is not in it
    shared = {
        site: torch.load(loop.state_dir(site) / "run" / "state_r0002.pt", weights_only=False)[
            "shared"
        ]
        for site in loop.sites
    }
    global_model = torch.load(loop.run_dir / "checkpoints" / "server.pt", weights_only=False)[
        "global_model"
    ]
    assert shared["A"]
    for key in shared["A"]:
        torch.testing.assert_close(global_model[key], (shared["A"][key] + shared["B"][key]) / 2)
    assert any(
        not torch.allclose(global_model[k], (shared["A"][k] + shared["B"][k] + shared["D"][k]) / 3)
        for k in shared["A"]
    )


@pytest.mark.slow
def test_a_restarted_server_resumes_after_its_last_completed_round_and_matches_in_process(
    tiny_root, tmp_path
):
    """Two sites, three rounds; the server (train_fed.py, SuperLink, ServerApp) is SIGKILLed once
    round 1 is complete and restarted with ``resume=<run dir>``; the sites keep running.
    Device: train.device=auto (CUDA where present) with the tiny experiment's
    train.deterministic=true, so the match holds bit for bit on the CPU and on one GPU."""
    overrides = ["train.total_iters=6", "train.eval_every=3", "data.out_of_federation=[]"]
    loop = Loopback(tmp_path / "loop", tiny_root, ["A", "D"], overrides)
    server_log = loop.run_dir / "log.txt"
    try:
        server = loop.start_server()
        for site in loop.sites:
            # the sites wait for the restarted server: its start (imports, SuperLink, keys) may
            # take minutes on a loaded machine, past the default deploy.connect_timeout
            loop.start_site(site, "deploy.connect_timeout=300")
        deadline = time.monotonic() + SERVER_TIMEOUT
        while not (server_log.exists() and "round 1/3 done" in server_log.read_text()):
            assert time.monotonic() < deadline and server.poll() is None, loop.output("server")
            time.sleep(0.5)
        os.killpg(server.pid, signal.SIGKILL)  # train_fed.py, SuperLink, flwr run, ServerApp
        server.wait(30)
        # nothing of the killed server outlives it for long: Flower starts the ServerApp under a
        # SuperExec in a session of its own, and the ServerApp ends when the SuperExec is gone
        deadline = time.monotonic() + 60
        while leftover := leftover_processes(str(loop.run_dir)):
            assert time.monotonic() < deadline, leftover
            time.sleep(1)
        checkpoint = torch.load(loop.run_dir / "checkpoints" / "server.pt", weights_only=False)
        assert checkpoint["round"] in (1, 2)  # killed after round 1 (or 2) was complete
        killed_after = checkpoint["round"]
        restarted = loop.restart_server()
        assert restarted.wait(timeout=SERVER_TIMEOUT) == 0, loop.output("server_resumed")[-3000:]
        # the server stopped its SuperLink itself (FLWR_HOME is under the run directory)
        superlinks = [p for p in leftover_processes(str(loop.run_dir)) if "flower-superlink" in p]
        assert superlinks == []
    finally:
        loop.stop_all()
    assert leftover_processes(str(tmp_path / "loop")) == []
    assert f"resuming {loop.run_dir} after round {killed_after}" in server_log.read_text()
    # every round appears once in the run's records, as in an uninterrupted run
    participation = read_jsonl(loop.run_dir / "participation.jsonl")
    assert [row["round"] for row in participation] == [1, 2, 3]
    assert all(row["missing"] == [] for row in participation)

    cfg = experiment(tiny_root, *overrides, "data.federation=[A,D]")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in every deployed process (OMP_NUM_THREADS=1)
    try:
        inprocess = run_training(cfg, tmp_path / "inprocess", progress=False)
    finally:
        torch.set_num_threads(threads)
    deployed = json.loads((loop.run_dir / "final.json").read_text())
    assert deployed["rounds"] == inprocess["rounds"] == 3
    assert deployed["sites"] == inprocess["sites"]
    losses = {
        name: sorted((r["round"], r["site"], r.get("loss")) for r in read_jsonl(d / "train.jsonl"))
        for name, d in (("deployed", loop.run_dir), ("inprocess", tmp_path / "inprocess"))
    }
    assert losses["deployed"] == losses["inprocess"]


@pytest.mark.slow
def test_flwr_run_with_an_empty_run_dir_makes_and_writes_a_new_run_directory(tiny_root, tmp_path):
    """``flwr run <app> <connection>`` as a Flower user would, against a SuperLink with TLS and
    SuperNode authentication and two sites: run-dir is empty, so the ServerApp composes the
    experiment from the run config's Hydra ``overrides`` and makes its own run directory."""
    sites, overrides = ["A", "D"], ["train.total_iters=2", "data.out_of_federation=[]"]
    loop = Loopback(tmp_path / "loop", tiny_root, sites, overrides)
    runs = tmp_path / "runs"
    hydra = ["experiment=tiny", f"data.root={tiny_root}", "data.federation=[A,D]", *overrides]
    run_config = {"run-dir": "", "overrides": " ".join(hydra), "runs": str(runs)}
    dcfg = DeployConfig(
        host="127.0.0.1", port=loop.port, certs=str(loop.certs), keys=str(loop.keys)
    )
    try:
        with deploy.running_superlink(sites, dcfg, tmp_path / "superlink") as env:
            for site in sites:
                loop.start_site(site)
            command = [str(deploy.BIN / "flwr"), "run", str(REPO), deploy.CONNECTION, "--stream"]
            command += [
                "--run-config",
                " ".join(f"{k}={json.dumps(v)}" for k, v in run_config.items()),
            ]
            flwr_run = loop._start("flwr_run", command, env)
            deadline = time.monotonic() + SERVER_TIMEOUT
            while not list(runs.glob("tiny/*/final.json")):
                assert time.monotonic() < deadline, loop.output("flwr_run")[-3000:]
                assert flwr_run.poll() in (None, 0), loop.output("flwr_run")[-3000:]
                time.sleep(1)
    finally:
        loop.stop_all()
    assert leftover_processes(str(tmp_path / "loop")) == []
    assert leftover_processes(str(tmp_path / "superlink")) == []  # FLWR_HOME of the SuperLink
    (run_dir,) = (runs / "tiny").iterdir()  # runs/<experiment name>/<method>_s<seed>_<time>
    assert run_dir.name.startswith("fedst_s0_")
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["data"]["federation"] == ["A", "D"] and saved["train"]["total_iters"] == 2
    final = json.loads((run_dir / "final.json").read_text())
    assert final["rounds"] == 1 and set(final["sites"]) == {"A", "D"}
    assert {row["site"] for row in read_jsonl(run_dir / "metrics.jsonl")} == {"A", "D"}
    assert (run_dir / "checkpoints" / "server.pt").is_file()
    assert f"deployed run {run_dir}" in (run_dir / "log.txt").read_text()
