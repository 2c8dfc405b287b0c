"""Specification of ``engine=ray`` under real Ray (issue 44): the same numbers as the in-process
engine, each site in one actor built once, and the mistakes that would hang Ray ending in one line.

The runs go through ``train_fed.py`` in a child process each (Ray's driver state stays out of the
test process), with ``OMP_NUM_THREADS=1``: Ray's actors compute on one thread, so the in-process
run must too for the same float sums. Two sites, three rounds of the tiny experiment; FedST and
FedAvg. Several minutes on 2 cores: marked slow (``make test-slow``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedst.config import ConfigError
from fedst.experiment.runtime import RayConfig
from fedst.training import ray_client_resources

REPO = Path(__file__).resolve().parents[1]

VOLATILE = ("seconds", "bytes", "process", "site_built", "state_restores")
"""train.jsonl fields that may differ between engines and runs: times, memory, placement."""


def test_a_gpu_share_on_a_machine_without_gpus_is_a_one_line_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    ray = RayConfig(num_gpus_per_site=0.5)
    with pytest.raises(ConfigError, match=r"ray\.num_gpus_per_site=0\.5 but torch sees no CUDA"):
        ray_client_resources(ray, 2, cpu_count=2)
    assert ray_client_resources(RayConfig(), 2, cpu_count=2)["num_gpus"] == 0.0  # auto: none


def train(run_dir: Path, data_root: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    command = [
        sys.executable,
        "train_fed.py",
        "experiment=tiny",
        "data.federation=[A,B]",
        "data.out_of_federation=[E]",
        "train.total_iters=6",  # 3 rounds of 2 local iterations
        f"data.root={data_root}",
        f"hydra.run.dir={run_dir}",
        "progress=false",
        *overrides,
    ]
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False
    )


def rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def numbers(run_dir: Path) -> dict[str, list]:
    """Every per-round figure but times, memory and placement, in a stable order."""

    def kept(row: dict) -> dict:
        return {k: v for k, v in row.items() if not any(part in k for part in VOLATILE)}

    key = lambda row: (row.get("round", -1), str(row.get("site")), str(row.get("model")))  # noqa: E731
    return {
        name: sorted((kept(r) for r in rows(run_dir, name)), key=key)
        for name in ("train.jsonl", "metrics.jsonl")
    }


def placements(run_dir: Path) -> dict[str, list[tuple[int, int, int]]]:
    """site -> (process, site_built, state_restores) of each of its train rows, by round."""
    found: dict[str, list[tuple[int, int, int]]] = {}
    for row in sorted(rows(run_dir, "train.jsonl"), key=lambda r: r.get("round", 0)):
        if row.get("site") not in (None, "server") and "process" in row:
            found.setdefault(row["site"], []).append(
                (row["process"], row["site_built"], row["state_restores"])
            )
    return found


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ray") / "tiny"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedst", "fedavg"])
def test_ray_gives_the_in_process_numbers_and_each_site_keeps_its_actor(
    data_root, tmp_path, method
):
    inprocess, ray = tmp_path / "inprocess", tmp_path / "ray"
    done = train(inprocess, data_root, f"method={method}")
    assert done.returncode == 0, done.stderr[-3000:]
    done = train(ray, data_root, f"method={method}", "engine=ray")
    assert done.returncode == 0, done.stderr[-3000:]
    # the same losses, update norms, SERQ figures and scores, to the last digit: the sites
    # compute on one thread in both engines, and the server aggregates in federation order
    assert numbers(ray) == numbers(inprocess)
    # under Ray, each site ran in one actor process, was built there once and never restored its
    # state from disk (ray.site_affinity=true, the default, with one actor per site)
    placed = placements(ray)
    assert set(placed) == {"A", "B"}
    for site, events in placed.items():
        assert len(events) == 3, (site, events)
        assert len({process for process, _, _ in events}) == 1, (site, events)
        assert [built for _, built, _ in events] == [1, 0, 0], (site, events)
        assert sum(restores for _, _, restores in events) == 0, (site, events)
    assert {events[0][0] for events in placed.values()} != {os.getpid()}
    assert len({events[0][0] for events in placed.values()}) == 2  # two actors, one per site
    # in-process, every site runs in the server's process
    assert (
        len({process for events in placements(inprocess).values() for process, _, _ in events}) == 1
    )


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_a_simulation_runs_across_a_two_node_ray_cluster_as_in_process(data_root, tmp_path):
    """ray.address: a head and a worker node started here (one core each; docs/paper-scale.md,
    "On a Ray cluster"), the run's two site actors placed on them, the in-process numbers."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    port = _free_port()
    start = [ray_cli, "start", "--num-cpus=1", "--num-gpus=0", "--disable-usage-stats"]
    try:
        head = subprocess.run([*start, "--head", f"--port={port}", "--include-dashboard=false"],
                              env=env, capture_output=True, text=True, timeout=180, check=False)  # fmt: skip
        assert head.returncode == 0, head.stderr[-2000:]
        worker = subprocess.run([*start, f"--address=127.0.0.1:{port}"], env=env,
                                capture_output=True, text=True, timeout=180, check=False)  # fmt: skip
        assert worker.returncode == 0, worker.stderr[-2000:]
        done = train(tmp_path / "cluster", data_root, "method=fedavg", "engine=ray",
                     f"ray.address=127.0.0.1:{port}", "ray.num_cpus_per_site=1")  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        count = (
            f"import ray; ray.init(address='127.0.0.1:{port}'); "
            "print(sum(n['Alive'] for n in ray.nodes()))"
        )
        nodes = subprocess.run(
            [sys.executable, "-c", count],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert nodes.stdout.strip().splitlines()[-1] == "2", nodes.stderr[-2000:]
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
    done = train(tmp_path / "inprocess", data_root, "method=fedavg")
    assert done.returncode == 0, done.stderr[-3000:]
    assert numbers(tmp_path / "cluster") == numbers(tmp_path / "inprocess")
    # one core per node and one per site: each node ran one site's actor
    placed = placements(tmp_path / "cluster")
    assert len({events[0][0] for events in placed.values()}) == 2


def _kill_site_after_round(run_dir: Path, site: str, after_round: int, process) -> int | None:
    """SIGKILL ``site``'s actor process once the server logged ``after_round`` (its row comes after
    the round's evaluation and checkpoint, so the next round's training is starting: ten local
    iterations, seconds here); returns the killed pid (None: the run ended first)."""
    import signal
    import time

    log = run_dir / "train.jsonl"
    while process.poll() is None:
        time.sleep(0.3)
        if not log.is_file():
            continue
        rows_now = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        if any(r.get("round") == after_round and r.get("site") == "server" for r in rows_now):
            pid = next(r["process"] for r in rows_now if r.get("site") == site)
            time.sleep(0.2)
            os.kill(pid, signal.SIGKILL)
            return pid
    return None


@pytest.mark.slow
def test_a_site_actor_killed_in_a_round_stops_the_run_in_one_line_and_resume_equals_no_kill(
    data_root, tmp_path
):
    """A site's process dying during round 2 (its Ray actor SIGKILLed): with every site needed
    (the simulation's default), the run stops with one line naming the site, keeps round 1, and
    ``resume=`` finishes it with the numbers of a run that was never interrupted."""
    longer = ["method=fedavg", "train.local_iters=10", "train.total_iters=30"]  # 3 rounds
    killed_run = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    command = [sys.executable, "train_fed.py", "experiment=tiny", "data.federation=[A,B]",
               "data.out_of_federation=[E]", f"data.root={data_root}", "progress=false",
               "engine=ray", *longer]  # fmt: skip
    with (tmp_path / "killed.out").open("w") as out:
        process = subprocess.Popen([*command, f"hydra.run.dir={killed_run}"], cwd=REPO, env=env,
                                   stdout=out, stderr=subprocess.PIPE, text=True)  # fmt: skip
        pid = _kill_site_after_round(killed_run, "A", 1, process)
        _, stderr = process.communicate(timeout=600)
    assert pid is not None, "the run ended before round 1 was logged"
    errors = [line for line in stderr.splitlines() if line.startswith("train_fed.py: error:")]
    assert process.returncode == 2 and len(errors) == 1, stderr[-3000:]
    assert "failed during train of round 2" in errors[0] and "A: " in errors[0]
    assert "ActorDiedError" in errors[0] and "resume" in errors[0]
    assert stderr.strip().splitlines()[-1] == errors[0]  # the last word, after Flower's own log
    assert 'train_fed.py", line' not in stderr  # no traceback of the entry point
    resume = [
        sys.executable,
        "train_fed.py",
        f"resume={killed_run}",
        "engine=ray",
        "progress=false",
    ]
    done = subprocess.run(resume, cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    done = train(tmp_path / "whole", data_root, *longer)
    assert done.returncode == 0, done.stderr[-3000:]
    assert numbers(killed_run) == numbers(tmp_path / "whole")
