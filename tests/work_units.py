"""How ``make test`` (``-n 3 --dist loadfile``) and ``make test-slow`` (``-n 2``) deal the test
files to their pytest-xdist workers: the files that read a run the session shares as one unit, the
longest units first. tests/conftest.py imports the hook from here."""

from __future__ import annotations

import pytest

SHARED_RUN_FILES = (
    "tests/test_deploy_local.py",
    "tests/test_device_override.py",
    "tests/test_federation.py",
    "tests/test_footprint.py",
    "tests/test_run_logs.py",
)
"""The test files that read a run the session shares (:func:`tiny_run`, :func:`tiny_cli_run`):
``make test`` (``-n 3 --dist loadfile``) runs them on one pytest-xdist worker, so each shared run
is trained once (every other file goes to one worker as a whole)."""


SHARED_RUNS = "the runs the session shares"
"""The xdist work unit of the files of :data:`SHARED_RUN_FILES`."""

LONGEST_FILES_FIRST = (
    SHARED_RUNS,
    "tests/test_gpu_check.py",
    "tests/test_deployment.py",
    "tests/test_ray_engine.py",
    "tests/test_temporal_control.py",
)
"""The work units handed out first, longest first, so that no long one starts last while the
other worker idles. Slow tier (``pytest -m slow --durations=0``, 2026-12-06, loaded 2-core
machine): the GPU rehearsal 642 s, the deployments 846 s in all, Ray 483 s, the temporal
control 409 s; in ``make test`` the shared runs are the largest unit. Every other file follows
in xdist's order (most tests first)."""


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # optional: pytest-xdist may be absent
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` with the files of :data:`SHARED_RUN_FILES` as one unit and the units
    of :data:`LONGEST_FILES_FIRST` handed out first. (xdist's own ``--dist loadgroup`` marks no
    group under pytest 9: it renames ``item._nodeid``, which pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedRunsOnOneWorker(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_RUNS if scope in SHARED_RUN_FILES else scope

        def _assign_work_unit(self, node) -> None:
            for scope in reversed(LONGEST_FILES_FIRST):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return SharedRunsOnOneWorker(config, log)
