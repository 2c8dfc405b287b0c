# Over 600 lines: one table of a new user's mistakes (MISTAKES) and the checks that run its rows,
# read together; its module fixtures build the runs the rows need once.
"""Specification (issue 36): every mistake a new user makes ends in one line and leaves nothing
behind.

:data:`MISTAKES` is one table of mistakes, each run as the real entry point (its script or module
as ``__main__``, in process: tests/conftest.py run_in_process) from an empty working directory:
its exit status, a phrase of its one error line, no traceback, and no file or folder left in the
working directory (nor at the paths the row names). The first row of each program also runs in a
process of its own (:data:`IN_A_PROCESS`), so the exit status and the one line are checked end to
end. ``{run}`` in a row stands for a run directory holding only the config.json train_fed.py
writes first; it must be unchanged afterwards too. Below the table: the error boundary
(fedst/errors.py) and the removal of unfinished run directories (fedst/cli.py) in process.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from fedst.app.messaging import FederationError
from fedst.cli import (
    NewRunDirectories,
    compose_experiment,
    console_held_while_setting_up,
    remove_unfinished_runs,
)
from fedst.config import ConfigError, build
from fedst.data import check
from fedst.data.base import DataError
from fedst.data.clips import ClipConfig
from fedst.data.procedural import generate
from fedst.data.site_checks import validate_experiment_data
from fedst.errors import ArgumentParser, UserError, one_line, run_entry_point
from fedst.experiment import TrainConfig
from fedst.federation.site import Site
from fedst.progress import SHOW_NOW
from fedst.report.results import RunError, group_by_method, load_runs
from fedst.training import check_resumable, run_training, save_config
from tests.conftest import REPO, run_command

MISTAKES = [  # (command line, exit status, a phrase of the error line, paths that must not exist)
    (["eval_outfed.py"], 2, "run=RUN_DIR is missing", []),
    (["eval_outfed.py", "run=nope"], 2, "run=nope: no such folder", ["nope"]),
    (["eval_outfed.py", "run={run}", "max_frame=5"], 2, "did you mean 'max_frames'?", []),
    (["eval_outfed.py", "run={run}", "+max_frame=5"], 2, "did you mean 'max_frames'?", []),
    (["eval_outfed.py", "run={run}", "unseen_indicator=owm"], 2, "owm: choose one of", []),
    (["eval_outfed.py", "run={run}", "sites=[X]"], 2, "'X'", ["{run}/.eval_outfed"]),
    (["train_fed.py", "train.totl_iters=5"], 2, "did you mean 'train.total_iters'?", []),
    (["train_fed.py", "+train.totl_iters=5"], 2, "did you mean 'total_iters'?", []),
    (["train_fed.py", "experiment=papr"], 2, "experiment=papr: no such option", []),
    (["train_fed.py", "resume=nope"], 2, "resume=nope: no such folder", ["nope"]),
    (["train_fed.py", "train.lr=abc"], 2, "train.lr='abc' (str): expected a number", []),
    (["train_fed.py", "train.rounds=5"], 2, "set train.total_iters=100 for 5 rounds", ["runs"]),
    (["train_fed.py", "method=upperbound", "method.communicate=true"], 2, "communicate=false", []),
    (["train_fed.py", "-m", "seed=0,1", "train.lr=abc"], 2, "expected a number", []),
    (["-m", "fedst.paper", "table2", "rows=fedsst", "--dry-run"], 2, "['fedsst']", []),
    (["-m", "fedst.report", "nope"], 2, "nope", ["nope/report"]),
    (["-m", "fedst.infer", "run=nope", "site=A", "input=a.mp4"], 2, "does not exist", ["nope"]),
    # issue 46
    (["eval_outfed.py", "run={run}"], 2, "no round of its training has completed", []),
    pytest.param(
        ["train_fed.py", "train.device=cuda"],
        2,
        "use train.device=auto or train.device=cpu",
        ["runs"],
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="not a mistake on a GPU"),
    ),
    (["-m", "fedst.infer", "run={run}", "site=A", "inptu=a.mp4"], 2, "(did you mean 'input'?)", []),
    (
        ["-m", "fedst.infer", "run={run}", "site=A", "input=a", "output={file}"],
        2,
        "not a folder",
        [],
    ),
    (["-m", "fedst.report", "{run}", "--out", "{file}"], 2, "--out={file}: not a folder", []),
    (["-m", "fedst.report", "matrix", "{run}", "--out", "{file}"], 2, "not a folder", []),
    (["-m", "fedst.report", "{run}", "--nope"], 2, "unrecognized arguments: --nope", []),
    (
        ["-m", "fedst.deploy", "local", "--workdir", "{file}"],
        2,
        "--workdir={file}: not a folder",
        [],
    ),
    (["-m", "fedst.deploy", "local", "--sites", "A", "engine=ray"], 2, "deployment engine", []),
    (["-m", "fedst.deploy", "local", "--sites", "A", "experiment=papr"], 2, "papr", []),
    (["-m", "fedst.deploy", "lcoal"], 2, "invalid choice: 'lcoal'", []),
    (["-m", "fedst.data.check", "data=tinyy"], 2, "(did you mean 'tiny'?)", []),
    (["-m", "fedst.data.check", "data=tiny", "site=Z"], 2, "site=Z: not in the data config", []),
    (["-m", "fedst.data.check", "--max-frames", "x"], 2, "max_frames=x: expected an integer", []),
    (["-m", "fedst.paper", "table22"], 2, "invalid choice: 'table22'", []),
    (
        ["train_fed.py", "experiment=tiny", "data.root={damaged}", "progress=false"],
        2,
        "missing mask of an annotated frame",
        ["runs"],
    ),
    (["train_fed.py", "resume={finished}"], 2, "the run is finished", []),
    (["-m", "fedst.report", "{touched}"], 2, "not a finished run, it trained 1 of 2 rounds", []),
]
"""``{run}``: the :func:`run_dir` fixture; ``{file}``: a file (:func:`a_file`); ``{damaged}``:
tiny data with a mask missing (:func:`damaged_data`); ``{finished}`` / ``{touched}``: a finished
run / an interrupted one whose final.json an evaluation wrote (:func:`reported_runs`). The error line is the one line on stderr, Hydra's own
log of a sweep aside (:func:`error_lines`). Every mistake reaches the boundary: status 2."""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory as train_fed.py starts one: its config.json (experiment=tiny)."""
    run = tmp_path_factory.mktemp("run")
    save_config(compose_experiment(["experiment=tiny"])[0], run)
    return run


@pytest.fixture(scope="module")
def a_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file where a command expects a folder (output=, --out, --workdir)."""
    path = tmp_path_factory.mktemp("file") / "results.txt"
    path.write_text("not a folder\n")
    return path


@pytest.fixture(scope="module")
def damaged_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny benchmark with one mask of a federated site's annotated frame deleted."""
    root = tmp_path_factory.mktemp("damaged") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    next((root / "D" / "videos").glob("*/masks/*.png")).unlink()
    return root


@pytest.fixture(scope="module")
def reported_runs(tmp_path_factory: pytest.TempPathFactory, tiny_config) -> dict[str, Path]:
    """``{finished}``: a run as the report reads it after its 2 rounds; ``{touched}``: one whose
    final.json an evaluation wrote after round 1 (eval_outfed.py before issue 46)."""
    root = tmp_path_factory.mktemp("reported")
    return {
        "{finished}": reported_run(root, "finished", tiny_config, 0, 30.0),
        "{touched}": reported_run(root, "touched", tiny_config, 1, 0.0, rounds=1),
    }


def program_of(argv: list[str]) -> str:
    """The name an entry point gives itself in its error line: train_fed.py, python -m fedst.x."""
    return argv[0] if argv[0].endswith(".py") else f"python -m {argv[1]}"


def tree(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def error_lines(stderr: str) -> list[str]:
    """The lines of stderr that report the error: all of them, but Hydra's sweep log (its
    "[HYDRA]" lines and the "Error executing job with overrides" line naming the failed job)."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip()
        and "[HYDRA]" not in line
        and not line.startswith("Error executing job with overrides:")
    ]


def row_id(row) -> str:
    """A row's test id: its command line (a row or a pytest.param)."""
    return " ".join(getattr(row, "values", row)[0])


IN_A_PROCESS = [
    row
    for index, row in enumerate(MISTAKES)
    if program_of(getattr(row, "values", row)[0])
    not in {program_of(getattr(r, "values", r)[0]) for r in MISTAKES[:index]}
]
"""The first row of each program in :data:`MISTAKES`, run again in a process of its own."""


def check_a_mistake(run, argv, status, phrase, absent, run_dir, a_file, tmp_path, request):
    """Run the mistake ``argv`` with ``run`` (:func:`run_command` or :func:`run_in_process`) from
    the empty ``tmp_path`` and check its status, its one error line and that nothing is left."""
    argv = [arg.replace("{run}", str(run_dir)).replace("{file}", str(a_file)) for arg in argv]
    if any("{damaged}" in arg for arg in argv):  # generated only for the rows that name it
        damaged = str(request.getfixturevalue("damaged_data"))
        argv = [arg.replace("{damaged}", damaged) for arg in argv]
    for name, path in request.getfixturevalue("reported_runs").items():
        argv = [arg.replace(name, str(path)) for arg in argv]
    phrase = phrase.replace("{file}", str(a_file))
    run_before = tree(run_dir)
    temp = request.getfixturevalue("tmp_path_factory").mktemp("system_temp")  # its temp folder
    done = run(argv, tmp_path, TMPDIR=str(temp))
    output = done.stdout + done.stderr
    assert done.returncode == status, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and phrase in lines[0], done.stderr[-3000:]
    assert lines[0].startswith(f"{program_of(argv)}: error: "), lines[0]
    assert tree(tmp_path) == []  # no run, Hydra or log folder in the working directory
    assert tree(temp) == []  # nor in the system temp folder
    assert tree(run_dir) == run_before  # and nothing written into the run
    for path in absent:
        assert not (tmp_path / path.replace("{run}", str(run_dir))).exists(), path


@pytest.mark.parametrize(
    ("argv", "status", "phrase", "absent"), MISTAKES, ids=[row_id(m) for m in MISTAKES]
)
def test_a_mistake_ends_in_one_line_and_leaves_nothing_behind(
    argv, status, phrase, absent, run_dir, a_file, tmp_path, in_process, request
):
    check_a_mistake(in_process, argv, status, phrase, absent, run_dir, a_file, tmp_path, request)


@pytest.mark.parametrize(
    ("argv", "status", "phrase", "absent"), IN_A_PROCESS, ids=[row_id(m) for m in IN_A_PROCESS]
)
def test_a_mistake_of_each_program_ends_in_one_line_in_a_process_of_its_own(
    argv, status, phrase, absent, run_dir, a_file, tmp_path, request
):
    check_a_mistake(run_command, argv, status, phrase, absent, run_dir, a_file, tmp_path, request)


DEBUGGED = [  # (command line, a phrase of its error line): one mistake of each program
    (["train_fed.py", "train.lr=abc"], "train.lr='abc' (str): expected a number"),
    (["eval_outfed.py", "run=nope"], "run=nope: no such folder"),
    (["-m", "fedst.data.check", "data=tinyy"], "(did you mean 'tiny'?)"),
    (["-m", "fedst.paper", "table2", "rows=fedsst", "--dry-run"], "['fedsst']"),
    (["-m", "fedst.report", "nope"], "nope"),
    (["-m", "fedst.infer", "run=nope", "site=A", "input=a.mp4"], "does not exist"),
    (["-m", "fedst.deploy", "local", "--sites", "A", "engine=ray"], "deployment engine"),
]
"""Issue 46: FEDST_DEBUG=1 exited 1 (train_fed.py) or was ignored (fedst.data.check). In process;
train_fed.py's row (the one that exited 1) also in a process of its own."""


def check_a_debugged_mistake(run, argv, phrase, tmp_path, tmp_path_factory) -> None:
    temp = tmp_path_factory.mktemp("system_temp")
    done = run(argv, tmp_path, FEDST_DEBUG="1", TMPDIR=str(temp))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{program_of(argv)}: error: ") and phrase in last, last
    assert tree(tmp_path) == []  # the run directory Hydra made for it is gone all the same


@pytest.mark.parametrize(("argv", "phrase"), DEBUGGED, ids=[" ".join(a) for a, _ in DEBUGGED])
def test_fedst_debug_shows_the_traceback_of_a_mistake_and_keeps_its_line_and_status(
    argv, phrase, tmp_path, tmp_path_factory, in_process
):
    check_a_debugged_mistake(in_process, argv, phrase, tmp_path, tmp_path_factory)


def test_fedst_debug_keeps_train_feds_line_and_status_in_a_process_of_its_own(
    tmp_path, tmp_path_factory
):
    argv, phrase = DEBUGGED[0]
    check_a_debugged_mistake(run_command, argv, phrase, tmp_path, tmp_path_factory)


def test_eval_outfed_help_lists_its_keys_and_no_config_group_it_refuses(tmp_path, in_process):
    done = in_process(["eval_outfed.py", "--help"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "max_frames: null" in done.stdout  # every key, with its default
    assert "groups" not in done.stdout and "experiment" not in done.stdout, done.stdout
    assert tree(tmp_path) == []


# -- the boundary, in process ---------------------------------------------------------------------


def exit_of(main, capsys, monkeypatch) -> tuple[int, str]:
    """(exit status, stderr) of ``run_entry_point(main, "prog")``."""
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # restored afterwards (the boundary sets it)
    with pytest.raises(SystemExit) as stopped:
        run_entry_point(main, "prog")
    return stopped.value.code, capsys.readouterr().err


def fail(error: BaseException):
    def main():
        raise error

    return main


def test_a_user_error_is_one_line_on_stderr_with_exit_status_2(capsys, monkeypatch):
    status, err = exit_of(fail(ConfigError("train.lr=-1: must be > 0")), capsys, monkeypatch)
    assert status == 2
    assert err == "prog: error: train.lr=-1: must be > 0 (FEDST_DEBUG=1 shows the traceback)\n"


def test_a_multi_line_message_is_folded_to_its_first_paragraph(capsys, monkeypatch):
    error = MissingConfigException(
        "In 'config': Could not find 'experiment/papr'\n\nAvailable options in 'experiment':\n"
        "\tdemo\n\tpaper\nConfig search path:\n\tprovider=main",
        "experiment/papr",
        ["demo", "paper"],
    )
    status, err = exit_of(fail(error), capsys, monkeypatch)
    assert status == 2
    assert err.startswith(
        "prog: error: In 'config': Could not find 'experiment/papr'; available: demo, paper ("
    )
    assert err.count("\n") == 1


def test_an_omegaconf_error_gives_its_sentence_and_key_not_its_node_types():
    cfg = OmegaConf.create({"run": "???"})
    with pytest.raises(MissingMandatoryValue) as caught:
        _ = cfg.run
    assert "\n" in str(caught.value)  # OmegaConf's own message has the node's lines
    assert one_line(caught.value) == "Missing mandatory value: run"


def test_an_interpolation_that_fails_on_a_user_error_gives_that_error():
    def refuse(value):
        raise ConfigError(f"x={value}: must be an integer")

    OmegaConf.register_new_resolver("test_refuse", refuse, replace=True)
    cfg = OmegaConf.create({"x": "${test_refuse:abc}"})
    with pytest.raises(InterpolationResolutionError) as caught:
        _ = cfg.x
    assert one_line(caught.value) == "x=abc: must be an integer"


def test_a_bug_keeps_its_traceback(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(KeyError):
        run_entry_point(fail(KeyError("a bug")), "prog")


def test_fedst_debug_prints_a_user_errors_traceback_then_its_line_with_exit_status_2(
    capsys, monkeypatch
):
    monkeypatch.setenv("FEDST_DEBUG", "1")
    status, err = exit_of(fail(UserError("wrong")), capsys, monkeypatch)
    assert status == 2
    assert err.startswith("Traceback") and err.endswith("\nprog: error: wrong\n"), err


def test_ctrl_c_is_one_line_with_exit_status_130(capsys, monkeypatch):
    status, err = exit_of(fail(KeyboardInterrupt()), capsys, monkeypatch)
    assert (status, err) == (130, "prog: interrupted\n")


def test_ctrl_c_of_train_fed_says_how_to_resume_the_run_it_kept(capsys, monkeypatch, tmp_path):
    """train_fed.py's boundary appends train_fed.resume_hint: the run it trained in, once that
    run has a checkpoint (before one, the run is removed: nothing to resume)."""
    spec = importlib.util.spec_from_file_location("train_fed_entry", REPO / "train_fed.py")
    train_fed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_fed)
    run = tmp_path / "run"
    train_fed.STARTED_RUNS.append(run)
    assert train_fed.resume_hint() == ""
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "server.pt").write_bytes(b"")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(SystemExit) as stopped:
        run_entry_point(fail(KeyboardInterrupt()), "train_fed.py", train_fed.resume_hint)
    assert stopped.value.code == 130
    hint = f"train_fed.py: interrupted; continue it: python train_fed.py resume={run}\n"
    assert capsys.readouterr().err == hint


def test_a_usage_mistake_of_an_argparse_command_is_a_user_error_without_usage_lines(capsys):
    parser = ArgumentParser(prog="prog")
    parser.add_argument("--out")
    with pytest.raises(UserError, match=r"^unrecognized arguments: --nope \(usage: prog --help\)$"):
        parser.parse_args(["--nope"])
    assert capsys.readouterr() == ("", "")


def test_the_exit_status_is_mains_integer_or_0(capsys, monkeypatch):
    assert exit_of(lambda: 1, capsys, monkeypatch)[0] == 1
    assert exit_of(lambda: [Path("written")], capsys, monkeypatch)[0] == 0
    assert exit_of(lambda: None, capsys, monkeypatch)[0] == 0


def test_an_unknown_key_of_a_section_names_the_closest_field():
    with pytest.raises(ConfigError, match=r"\(did you mean 'total_iters'\?\); allowed: \["):
        build(TrainConfig, {"totl_iters": 5}, "train")
    with pytest.raises(ConfigError) as caught:
        build(TrainConfig, {"zzz": 5}, "train")
    assert "did you mean" not in str(caught.value)  # nothing close: no guess


def test_a_runs_set_up_lines_reach_the_console_once_it_passed_and_never_before_its_error(
    monkeypatch,
):
    """Issue 46: a run stopped by a DataError printed its device and validation lines first."""
    console = io.StringIO()
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [logging.StreamHandler(console)])
    monkeypatch.setattr(root, "level", logging.INFO)
    log = logging.getLogger("fedst.set_up")
    with pytest.raises(DataError), console_held_while_setting_up():
        log.info("site A split test: 6 samples validated")
        raise DataError("site D: missing mask of an annotated frame")
    assert console.getvalue() == ""
    with console_held_while_setting_up():
        log.info("site A split test: 6 samples validated")
        assert console.getvalue() == ""
    assert console.getvalue() == "site A split test: 6 samples validated\n"
    with console_held_while_setting_up():  # a long step is said as it starts
        log.info("generating site(s) A", extra=SHOW_NOW)
        assert console.getvalue().endswith("generating site(s) A\n")


# -- run directories a failed command leaves ------------------------------------------------------


@pytest.fixture
def notes():
    NewRunDirectories.created.clear()
    yield NewRunDirectories
    NewRunDirectories.created.clear()


def hydra_makes(directory: Path, *files: str) -> Path:
    """What Hydra's run_job writes into a run directory before the job (plus ``files``)."""
    (directory / ".hydra").mkdir(parents=True)
    (directory / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (directory / "train_fed.log").write_text("")
    for name in files:
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text("{}\n")
    return directory


def test_a_new_run_without_results_is_removed_with_the_parents_it_created(notes, tmp_path):
    run = tmp_path / "runs" / "demo" / "fedst_s0_20260101-000000"
    notes._note(run, sweep=False)
    hydra_makes(run, "config.json", "device.jsonl", "log.txt", "benchmark.json")
    assert remove_unfinished_runs() == [run, run.parent, run.parent.parent]
    assert tree(tmp_path) == []


def test_a_run_with_results_is_kept(notes, tmp_path):
    for result in ("train.jsonl", "metrics.jsonl", "checkpoints/server.pt", "final.json"):
        run = tmp_path / result.replace("/", "_") / "run"
        notes._note(run, sweep=False)
        hydra_makes(run, "config.json", result)
    assert remove_unfinished_runs() == []
    assert len([p for p in tmp_path.iterdir()]) == 4


def test_a_directory_that_existed_before_is_never_removed(notes, tmp_path):
    existing = hydra_makes(tmp_path / "given")  # hydra.run.dir=given, or a resumed run
    notes._note(existing, sweep=False)
    assert remove_unfinished_runs() == []
    assert existing.is_dir()


def new_sweep(notes, directory: Path) -> Path:
    notes._note(directory, sweep=True)
    directory.mkdir(parents=True)
    (directory / "multirun.yaml").write_text("hydra: {}\n")
    return directory


def test_a_sweep_loses_its_unfinished_jobs_and_keeps_its_finished_ones(notes, tmp_path):
    sweep = new_sweep(notes, tmp_path / "multirun" / "demo" / "20260101-000000")
    failed = hydra_makes(sweep / "fedst_s0_0", "config.json")
    finished = hydra_makes(sweep / "fedst_s1_1", "config.json", "final.json")
    assert remove_unfinished_runs() == [failed]
    assert finished.is_dir()


def test_a_sweep_whose_jobs_all_failed_is_removed(notes, tmp_path):
    sweep = new_sweep(notes, tmp_path / "multirun" / "demo" / "20260101-000000")
    hydra_makes(sweep / "fedst_s0_0", "config.json")
    remove_unfinished_runs()
    assert tree(tmp_path) == []


# -- a run is finished only when its training finished (issue 46, point 1) ------------------------


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run of 3 rounds (no SERQ: fast) that stopped in round 2 when a site died: its
    checkpoint is round 1's, as after Ctrl-C in round 2."""
    root = tmp_path_factory.mktemp("data") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    overrides = ["experiment=tiny", "method.serq=false", "train.total_iters=6", f"data.root={root}"]
    cfg = compose_experiment(overrides)[0]
    run = tmp_path_factory.mktemp("runs") / "interrupted"
    original = Site.train_round

    def power_cut(self, received, server_round, local_iters, **kwargs):
        if server_round == 2:
            raise RuntimeError("power cut")
        return original(self, received, server_round, local_iters, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Site, "train_round", power_cut)
        with pytest.raises(FederationError):
            run_training(cfg, run, progress=False)
    return run


def test_evaluating_an_interrupted_run_scores_its_round_and_leaves_it_resumable_and_unreported(
    interrupted_run, tmp_path, in_process
):
    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    done = in_process(["eval_outfed.py", f"run={run}", "progress=false"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (run / "final.json").exists()  # only the end of training writes it
    assert set(json.loads((run / "outfed_r0001.json").read_text())) == {"E", "grasp"}
    assert (
        f"scores of round 1, kept out of final.json (resume it: python train_fed.py resume={run})"
        in done.stdout
    )
    check_resumable(run)  # no error: train_fed.py resume=run continues it
    with pytest.raises(RunError, match=r"incomplete run, missing final\.json"):
        load_runs([run])


def test_scoring_a_new_site_on_an_interrupted_run_names_the_round_it_scored(
    interrupted_run, tmp_path, in_process
):
    """external/<site>.json holds a finished run's score of the site; an unfinished run's is
    external/<site>_rNNNN.json, as its outfed_rNNNN.json, and the run stays resumable."""
    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    lung = tmp_path / "hospital" / "lung"  # site E's files as another hospital's folder
    shutil.copytree(Path(json.loads((run / "config.json").read_text())["data"]["root"]) / "E", lung)
    meta = json.loads((lung / "meta.json").read_text())
    del meta["generator"]
    (lung / "meta.json").write_text(json.dumps(meta))
    argv = ["eval_outfed.py", f"run={run}", f"site_root={lung}", "progress=false"]
    done = in_process(argv, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (run / "external").iterdir()) == ["lung_r0001.json", "results.md"]
    assert json.loads((run / "external" / "lung_r0001.json").read_text())["round"] == 1
    assert f"round 1, kept out of final.json (resume it: python train_fed.py resume={run})" in (
        done.stdout
    )
    check_resumable(run)


@pytest.fixture(scope="module")
def tiny_config():
    return compose_experiment(["experiment=tiny"])[0]


def reported_run(root: Path, name: str, cfg, seed: int, dice: float, rounds: int | None = None):
    """A run directory as the report reads it: config.json / .yaml, empty logs and a final.json
    of Dice ``dice`` at every site after ``rounds`` (default: all of ``cfg``'s) rounds."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(dataclasses.replace(cfg, seed=seed).to_json())
    (run / "config.yaml").write_text(f"seed: {seed}\n")
    for log_file in ("metrics.jsonl", "comm.jsonl"):
        (run / log_file).write_text("")
    final = {
        "method": cfg.method.name,
        "seed": seed,
        "experiment": cfg.name,
        "rounds": cfg.train.rounds if rounds is None else rounds,
        "sites": {site: {"dice": dice} for site in "ABCD"},
        "out_of_federation": {},
    }
    (run / "final.json").write_text(json.dumps(final))
    return run


def test_a_run_whose_final_json_an_evaluation_wrote_before_the_end_is_unfinished(
    tiny_config, tmp_path
):
    """eval_outfed.py before issue 46 wrote final.json into an interrupted run: that run is
    resumable, the report refuses it, and --skip-incomplete leaves the row as it was."""
    assert tiny_config.train.rounds == 2
    reported_run(tmp_path, "s0", tiny_config, 0, 30.0)
    reported_run(tmp_path, "s1", tiny_config, 1, 32.0)
    touched = reported_run(tmp_path, "s2", tiny_config, 2, 0.0, rounds=1)
    check_resumable(touched)  # no error
    with pytest.raises(RunError) as refused:
        load_runs([tmp_path])
    assert f"{touched}: not a finished run, it trained 1 of 2 rounds" in one_line(refused.value)
    [row] = group_by_method(load_runs([tmp_path], skip_incomplete=True)).values()
    assert sorted(run["seed"] for run in row) == [0, 1]


def test_identical_copies_of_one_run_count_once(tiny_config, tmp_path):
    """A copied run folder is one seed, not two (n=2 with std 0.00 before issue 46)."""
    first = reported_run(tmp_path, "s0", tiny_config, 0, 30.0)
    shutil.copytree(first, tmp_path / "s0_copy")
    reported_run(tmp_path, "s0_rerun_elsewhere", tiny_config, 0, 31.0)  # same seed, other scores
    reported_run(tmp_path, "s1", tiny_config, 1, 32.0)
    [row] = group_by_method(load_runs([tmp_path])).values()
    assert sorted(run["path"].name for run in row) == ["s0", "s0_rerun_elsewhere", "s1"]


# -- a label that meta.json promises is there (issue 46, point 3) --------------------------------


def generic_data_config(root: Path, path: Path) -> Path:
    """A data config (fedst.data.check's data=FILE) with one federated generic-layout site, D."""
    spec = {"backend": "generic", "root": str(root), "surgery_type": "hysterectomy"}
    lines = ["federation: [D]", "out_of_federation: []", "server: null", "val_split: dataset"]
    path.write_text("\n".join([*lines, "sites:", f"  D: {json.dumps(spec)}"]) + "\n")
    return path


@pytest.mark.parametrize("label_every", [1, 2])
def test_an_annotated_frame_without_its_mask_is_an_error_in_the_checker_and_before_training(
    write_site, tmp_path, capsys, label_every
):
    """meta.json's annotated_fps = fps / k: every k-th frame (index a multiple of k) has a mask.
    One of them deleted is an error naming the file; the frames in between have none."""
    written = write_site("D", videos={"v1": 8}, label_every=label_every)
    missing = written.masks["v1"][4]
    missing.unlink()
    config = generic_data_config(tmp_path, tmp_path / "data.yaml")
    assert check.main([f"data={config}"]) == 1
    assert f"{missing}: missing mask of an annotated frame" in capsys.readouterr().out
    with pytest.raises(DataError) as refused:
        validate_experiment_data(check.load_data_config(str(config)), ClipConfig(), ["D"])
    assert f"{missing}: missing mask of an annotated frame" in str(refused.value)


def test_frames_between_annotated_ones_need_no_mask(write_site, tmp_path, capsys):
    write_site("D", videos={"v1": 8}, label_every=2)  # masks of frames 0, 2, 4, 6 only
    config = generic_data_config(tmp_path, tmp_path / "data.yaml")
    assert check.main([f"data={config}"]) == 0, capsys.readouterr().out
