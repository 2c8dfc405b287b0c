"""Round time and memory as the federation grows: 4, 8, 16 sites on one machine, tiny preset, one
thread per process, the in-process engine, Flower's Ray simulation (``engine=ray``) and the
deployment engine (TLS and node authentication on 127.0.0.1).

    .venv/bin/python -m bench.deploy_scale                         # 4, 8 and 16 sites, every engine
    .venv/bin/python -m bench.deploy_scale --sites 4 --engines inprocess
    .venv/bin/python -m bench.deploy_scale --engines inprocess ray  # studies/ray_vs_inprocess/README.md
    .venv/bin/python -m bench.deploy_scale experiment=tiny train.total_iters=6 --sites 4 8 16  # 3 rounds

Sites beyond A-D read A-D's data again (``site_dir`` of the generic backend: S05 reads A, S06 B,
...), so every added site costs what one of the first four costs. Each run goes through the real
entry point as a child process (``train_fed.py`` in-process, ``python -m fedst.deploy local`` for
the deployment); the round times are the server's "round N done in X s" log lines. Memory is the
peak resident set (VmHWM) of each process, sampled from /proc every second: in-process the one
process holding every site, in deployment per site its executor (model, data, training), its
SuperNode and its site process (train_fed.py site=<name>), and the server's processes; under Ray
the driver (server), each site actor (``ray::ClientAppActor``) and Ray's own services (GCS,
raylet, dashboard, log monitor), and the sum of every process's peak (an upper bound of the
whole job's footprint: the peaks need not coincide).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.deploy_overhead import REPO, round_times
from bench.environment import child_environment
from bench.scratch import scratch_dir

FIRST_SITES = ("A", "B", "C", "D")


def site_names(count: int) -> list[str]:
    """A-D, then S05, S06, ... (each reading one of A-D's folders in turn)."""
    return [*FIRST_SITES[:count], *(f"S{i:02d}" for i in range(5, count + 1))]


def extra_site_overrides(count: int) -> list[str]:
    """Hydra overrides declaring the sites beyond A-D on the data of A-D (tiny preset's types)."""
    types = {"A": "nephrectomy", "B": "nephrectomy", "C": "prostatectomy", "D": "hysterectomy"}
    overrides = []
    for index, name in enumerate(site_names(count)[4:]):
        source = FIRST_SITES[index % 4]
        overrides.append(
            f"+data.sites.{name}={{backend: generic, root: '${{data.root}}', "
            f"surgery_type: {types[source]}, options: {{site_dir: {source}}}}}"
        )
    return overrides


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children.get(pid, [])
    return found


def _peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class MemorySampler:
    """Peak RSS in MB and command line of every process below ``pid``, sampled every second."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peaks, self.commands = pid, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for pid in _descendants(self.pid):
                peak = _peak_rss_mb(pid)
                if peak is not None:
                    self.peaks[pid] = max(peak, self.peaks.get(pid, 0.0))
                    # every name a process took: a Ray worker starts as ray::IDLE and renames
                    # itself once it hosts an actor (ray::ClientAppActor)
                    self.commands[pid] = f"{self.commands.get(pid, '')} {_cmdline(pid)}"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run(engine: str, count: int, overrides: list[str], work: Path, env: dict) -> dict:
    """One federation of ``count`` sites with ``engine``: round times and peak memory."""
    sites = site_names(count)
    overrides = [*overrides, *extra_site_overrides(count), "data.out_of_federation=[]"]
    if engine in ("inprocess", "ray"):
        run_dir = work / "run"
        command = [sys.executable, str(REPO / "train_fed.py"), *overrides]
        command += [f"data.federation=[{','.join(sites)}]", f"hydra.run.dir={run_dir}"]
        command += ["progress=false", f"engine={engine}"]
    else:
        run_dir = work / "run"
        command = [sys.executable, "-m", "fedst.deploy", "local", "--sites", *sites]
        command += ["--workdir", str(work), *overrides]
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with (work / "bench.out").open("wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        sampler = MemorySampler(process.pid)
        code = process.wait()
        sampler.stop()
    if code != 0:
        raise RuntimeError(f"{engine} with {count} sites failed ({code}): see {work / 'bench.out'}")
    memory: dict[str, list[float]] = {}
    for pid, peak in sampler.peaks.items():
        memory.setdefault(_role(sampler.commands[pid], pid == process.pid, engine), []).append(peak)
    return {
        "rounds": round_times(run_dir / "log.txt"),
        "wall": time.monotonic() - started,
        **memory,
        "all processes (sum of peaks)": [sum(sampler.peaks.values())],
    }


def _role(command: str, is_root: bool, engine: str) -> str:
    """Which part of a federation a process is, by its command line."""
    if engine == "inprocess" and is_root:
        return "process"
    if engine == "ray":
        if is_root:
            return "driver (server)"
        if "ClientAppActor" in command:
            return "site actor"
        return "Ray services and idle workers"
    if "fedst.app.site_executor" in command:
        return "site executor"
    if "flower-supernode" in command:
        return "site SuperNode"
    if "train_fed.py" in command and "site=server" not in command and "site=" in command:
        return "site process"
    return "server and other"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", default=["experiment=tiny"])
    parser.add_argument("--sites", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--engines", nargs="+", default=["inprocess", "ray", "deployment"])
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep the runs here (default: removed)"
    )
    args = parser.parse_args(argv)
    if not any(o.startswith("experiment=") for o in args.overrides):
        args.overrides.insert(0, "experiment=tiny")
    env = {**child_environment(), "OMP_NUM_THREADS": "1"}
    with scratch_dir("fedst_scale_", args.keep) as work:
        print(f"overrides: {' '.join(args.overrides)}; {os.cpu_count()} cores; work: {work}")
        for count in args.sites:
            for engine in args.engines:
                result = run(engine, count, args.overrides, work / f"{engine}_{count}", env)
                rounds = result["rounds"]
                memory = "; ".join(
                    f"{role} {max(peaks):.0f} MB" + (f" (x{len(peaks)})" if len(peaks) > 1 else "")
                    for role, peaks in sorted(result.items())
                    if role not in ("rounds", "wall")
                )
                print(
                    f"{count:>3} sites {engine:>10}: rounds {', '.join(f'{t:.1f}' for t in rounds)} s"
                    f" (mean {sum(rounds) / len(rounds):.1f} s/round, {result['wall']:.0f} s in all);"
                    f" peak RSS: {memory}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
