"""Per-round wall time of the deployment engine (SuperLink + one SuperNode per site, TLS and node
authentication, all on 127.0.0.1) against the in-process engine, same experiment and seed.

    .venv/bin/python -m bench.deploy_overhead                          # tiny preset, 4 sites
    .venv/bin/python -m bench.deploy_overhead experiment=demo train.total_iters=40

Both runs go through the real entry points as child processes (``train_fed.py`` and
``python -m fedst.deploy local``); the round times are the server's own "round N done in X s"
log lines. The difference is the deployment engine's overhead: each site runs one long-lived
ClientApp process (fedst.app.site_executor, which logs per message the time to pull it from the
SuperNode and the time of the FedST work), so what remains is mostly Flower's transport of the
parameters (a few buffers per message, fedst/federation/transport.py; SuperLink -> SuperNode ->
ClientApp) and its polling (docs/deployment.md, "What sets the time of a message").
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere, no install
from bench.environment import child_environment  # noqa: E402
from bench.scratch import scratch_dir  # noqa: E402

ROUND = re.compile(r"round (\d+)(?:/\d+)? done in ([\d.]+) s")


MESSAGE = re.compile(
    r"(\w+(?:\.\w+)?) message: pulled from the SuperNode in ([\d.]+) s, handled in ([\d.]+) s"
)


def round_times(log: Path) -> list[float]:
    return [float(m.group(2)) for m in ROUND.finditer(log.read_text(errors="replace"))]


def site_message_times(work: Path) -> dict[str, list[tuple[float, float]]]:
    """Per message type, (seconds to pull the message from the SuperNode, seconds of FedST work)
    of every message the sites' ClientApp executors ran (fedst.app.site_executor's log lines)."""
    times: dict[str, list[tuple[float, float]]] = {}
    for log in sorted(work.glob("sites/*/supernode_*.log")):
        for m in MESSAGE.finditer(log.read_text(errors="replace")):
            times.setdefault(m.group(1), []).append((float(m.group(2)), float(m.group(3))))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", default=["experiment=tiny"])
    parser.add_argument("--sites", nargs="+", default=["A", "B", "C", "D"])
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep the runs here (default: removed)"
    )
    args = parser.parse_args(argv)
    env = {**child_environment(), "OMP_NUM_THREADS": "1"}
    with scratch_dir("fedst_overhead_", args.keep) as work:
        federation = f"data.federation=[{','.join(args.sites)}]"
        results = {}
        for engine in ("inprocess", "deployment"):
            started = time.monotonic()
            if engine == "inprocess":
                run_dir = work / "inprocess"
                command = [sys.executable, str(REPO / "train_fed.py"), *args.overrides, federation]
                command += [f"hydra.run.dir={run_dir}", "progress=false"]
            else:
                run_dir = work / "deployment" / "run"
                command = [sys.executable, "-m", "fedst.deploy", "local", "--sites", *args.sites]
                command += ["--workdir", str(work / "deployment"), *args.overrides]
            subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
            times = round_times(run_dir / "log.txt")
            results[engine] = (times, time.monotonic() - started)
        print(f"overrides: {' '.join(args.overrides)}; sites: {' '.join(args.sites)}; work: {work}")
        for engine, (times, wall) in results.items():
            mean = sum(times) / len(times)
            print(
                f"{engine:>10}: rounds {', '.join(f'{t:.1f}' for t in times)} s; "
                f"mean {mean:.1f} s/round; whole command {wall:.0f} s"
            )
        base = sum(results["inprocess"][0]) / len(results["inprocess"][0])
        dep = sum(results["deployment"][0]) / len(results["deployment"][0])
        print(f"deployment overhead: {dep - base:+.1f} s/round ({dep / base:.1f}x in-process)")
        for kind, pairs in site_message_times(work / "deployment").items():
            pulls, work_seconds = [p for p, _ in pairs], [w for _, w in pairs]
            print(
                f"site {kind} messages ({len(pairs)}): pulled from the SuperNode in "
                f"{min(pulls):.1f}-{max(pulls):.1f} s, FedST work {min(work_seconds):.1f}-"
                f"{max(work_seconds):.1f} s"
            )


if __name__ == "__main__":
    main()
