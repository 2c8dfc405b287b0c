# FedST: `make demo` runs the main job, `make test` runs the checks (`make test-slow`: the scenarios
# of several minutes that `make test` leaves out). All set up .venv when missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
export FLWR_TELEMETRY_ENABLED := 0

.PHONY: venv test test-slow lint format demo bench gpu-wheels gpu-rehearsal clean-venv

venv: $(STAMP)

# torch is installed first, pinned, so no other requirement can pull a different build.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Three pytest workers (pytest-xdist) on the 2 cores, one thread each (N OpenMP threads per worker
# would thrash them): a third worker runs while the deployment tests wait on their processes
# (2026-12-06, same commit: 544 s with 3 workers, 574-624 s with 2, the same CPU time).
# --dist loadfile sends a whole test file to one worker (its module's runs are trained once), and
# the files that read the runs the session shares together (tests/work_units.py SHARED_RUN_FILES).
test: lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 3 --dist loadfile

# The tests marked slow (pyproject.toml; `make test` deselects them): the loopback deployments of a
# site killed during a round, a restarted server and `flwr run` with an empty run-dir, the GPU
# check rehearsed as the GPU machine runs it (make gpu-rehearsal), Ray, and the temporal module's
# positive control (tests/test_temporal_control.py, about 4 minutes on one core). Two workers as
# `make test` (the files are independent: each deployment and Ray cluster takes free ports), the
# longest files first (tests/work_units.py LONGEST_FILES_FIRST); CI (.ci/run) runs them after
# `make test`.
test-slow: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m slow -n 2 --dist loadfile

demo: venv
	$(BIN)/python -m fedst.demo

bench: venv
	$(BIN)/python -m bench.model
	$(BIN)/python -m bench.demo

# The wheels the GPU machine of `bash bench/gpu_check/gpu_check.sh` lacks (Python 3.12, manylinux x86-64),
# pinned to this .venv's versions, into .whl/ (git-ignored); docs/paper-scale.md, "The GPU check".
gpu-wheels: venv
	$(BIN)/python -m bench.gpu_check wheels

# The GPU check run here as the GPU machine runs it: a bare environment with that machine's packages,
# the rest as wheels on PYTHONPATH only (bench/gpu_check/rehearsal.py; report in gpu_rehearsal_out/).
# About 10 minutes on 2 cores; `make test-slow` runs it (tests/test_gpu_check.py).
gpu-rehearsal: venv
	$(BIN)/python -m bench.gpu_check.rehearsal

clean-venv:
	rm -rf $(VENV)
