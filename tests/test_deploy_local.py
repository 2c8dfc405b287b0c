"""A site and ``python -m fedst.deploy local`` before anything connects (issue 33, item 6):

* the documented ``local --sites A B C D experiment=tiny`` reaches four sites and one override;
* each local site process gets its own GPU (CUDA_VISIBLE_DEVICES) round-robin over the visible
  ones when there are several, respecting an existing CUDA_VISIBLE_DEVICES list;
* a site validates its whole dataset before its SuperNode starts: a bad file is one line naming
  the fix, and the time it took is logged;
* nothing lost by default (issue 59): the work folder is kept under runs/ and named, and a run
  leaves nothing in the temp folder.

No deployment process is started: fedst.deploy's ``start`` is replaced by a recorder (one test
runs train_fed.py's in-process engine in a process of its own).
"""

from __future__ import annotations

import importlib
import logging
import shutil
import tempfile
from pathlib import Path

import pytest

from fedst import deploy
from fedst.data.procedural import generate
from fedst.deploy import cli, supernode
from fedst.errors import UserError
from fedst.experiment import DeployConfig
from tests.test_federation import experiment

local = importlib.import_module("fedst.deploy.local")  # the package exports the function
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("procedural") / "tiny"
    generate(root, seed=0, preset="tiny", workers=1, progress=False)
    return root


# -- the command line ------------------------------------------------------------------------


def test_the_documented_local_command_takes_four_sites_and_one_override(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "local", lambda sites, overrides, workdir: seen.update(locals()) or 0)
    argv = ["local", "--sites", "A", "B", "C", "D", "experiment=tiny"]  # docs/deployment.md
    assert cli.main(argv) == 0
    assert seen["sites"] == ["A", "B", "C", "D"]
    assert seen["overrides"] == ["experiment=tiny"]
    cli.main(["local", "experiment=tiny", "+x=1", "--sites", "A", "D", "~y", "train.lr=0.1"])
    assert seen["sites"] == ["A", "D"]
    assert sorted(seen["overrides"]) == sorted(["experiment=tiny", "+x=1", "~y", "train.lr=0.1"])
    with pytest.raises(UserError, match="name at least one site"):  # overrides only: no site
        cli.main(["local", "--sites", "experiment=tiny"])


# -- one GPU per site ------------------------------------------------------------------------


def test_sites_get_the_visible_gpus_round_robin_and_share_when_there_is_one():
    sites = ["A", "B", "C", "D"]
    assert local.visible_gpus(device_count=2, visible=None) == ["0", "1"]
    assert local.site_gpus(sites, ["0", "1"]) == {"A": "0", "B": "1", "C": "0", "D": "1"}
    # an existing list is respected as written (indices or UUIDs), whatever torch counts
    assert local.visible_gpus(device_count=8, visible="3, 5,GPU-7f") == ["3", "5", "GPU-7f"]
    assert local.site_gpus(sites, ["3", "5", "GPU-7f"]) == {
        "A": "3",
        "B": "5",
        "C": "GPU-7f",
        "D": "3",
    }
    assert local.visible_gpus(device_count=4, visible="") == []  # hidden on purpose
    assert local.visible_gpus(device_count=4, visible="2,-1,3") == ["2"]  # CUDA stops at -1
    assert local.site_gpus(sites, ["0"]) == {} and local.site_gpus(sites, []) == {}


def test_local_starts_each_site_process_on_its_own_gpu(tiny_root, tmp_path, monkeypatch, caplog):
    started: list[tuple[list[str], dict[str, str]]] = []

    class Finished:
        def wait(self) -> int:
            return 0

    def record(command, log_path, env, new_group=True):
        started.append((command, env))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.touch()
        return Finished()

    monkeypatch.setattr(local, "start", record)
    monkeypatch.setattr(local, "stop", lambda process, grace=10.0: None)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 3)  # a machine with 3 GPUs
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with caplog.at_level(logging.INFO, logger="fedst.deploy"):
        assert (
            local.local(
                ["A", "B", "C", "D"], ["experiment=tiny", f"data.root={tiny_root}"], tmp_path
            )
            == 0
        )
    server, *sites = started
    assert "site=server" in server[0] and "CUDA_VISIBLE_DEVICES" not in server[1]
    gpus = {
        next(a for a in cmd if a.startswith("site="))[5:]: env["CUDA_VISIBLE_DEVICES"]
        for cmd, env in sites
    }
    assert gpus == {"A": "0", "B": "1", "C": "2", "D": "0"}
    assert "site A -> GPU 0, site B -> GPU 1, site C -> GPU 2, site D -> GPU 0" in caplog.text


def test_local_sites_with_auto_workers_share_the_cores(tiny_root, tmp_path, monkeypatch):
    started: list[list[str]] = []

    class Finished:
        def wait(self) -> int:
            return 0

    def record(command, log_path, env, new_group=True):
        started.append(command)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.touch()
        return Finished()

    monkeypatch.setattr(local, "start", record)
    monkeypatch.setattr(local, "stop", lambda process, grace=10.0: None)
    monkeypatch.setattr("fedst.data.clips.loaders.usable_cpu_count", lambda: 16)
    overrides = ["experiment=tiny", f"data.root={tiny_root}", "train.num_workers=auto"]
    assert local.local(["A", "B", "C", "D"], overrides, tmp_path) == 0
    for command in started[1:]:  # 16 cores // 4 loading sites - 1 training process = 3
        assert [a for a in command if a.startswith("train.num_workers=")] == ["train.num_workers=3"]


def test_local_keeps_its_run_under_the_runs_folder_by_default_and_says_where(
    tiny_root, tmp_path, monkeypatch, capsys
):
    """Issue 59: the run was deleted unless --workdir was given (issue 46 had moved it to a
    temporary folder removed at the end); now it is kept under runs/ and named, and nothing is
    left in the temp folder."""

    class Finished:
        def wait(self) -> int:
            return 0

    def record(command, log_path, env, new_group=True):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("the server's last lines\n")
        return Finished()

    monkeypatch.setattr(local, "start", record)
    monkeypatch.setattr(local, "stop", lambda process, grace=10.0: None)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    overrides = ["experiment=tiny", f"data.root={tiny_root}"]
    assert local.local(["A", "B"], overrides) == 0
    (kept,) = (project / "runs" / "deploy_local").iterdir()
    assert (kept / "certs" / "ca.crt").is_file() and (kept / "server.out").is_file()
    assert f"kept the work folder {kept}: the run is {kept / 'run'}" in capsys.readouterr().out
    assert list(temp.iterdir()) == []
    assert local.local(["A", "B"], overrides, tmp_path / "named") == 0
    assert (tmp_path / "named" / "certs" / "ca.crt").is_file() and list(temp.iterdir()) == []
    assert len(list((project / "runs" / "deploy_local").iterdir())) == 1


def test_a_run_leaves_nothing_in_the_temp_folder(tiny_cli_run):
    """Issue 59: importing torch made ``<temp>/torchinductor_<user>`` (its compile cache) in every
    run; FedST points it to the user's cache folder. The real entry point, in a process of its
    own whose temp folder is an empty folder: the session's run from the command line
    (tests/conftest.py)."""
    assert (tiny_cli_run.run_dir / "final.json").is_file()
    assert list(tiny_cli_run.temp.iterdir()) == []
    assert (tiny_cli_run.cache / "fedst" / "torchinductor").is_dir()


# -- data validated before connecting -------------------------------------------------------


def test_a_site_validates_its_data_before_its_supernode_starts(
    tiny_root, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("FEDST_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "data"
    shutil.copytree(tiny_root, root)
    cfg = experiment(root, "data.federation=[A,B]", "data.out_of_federation=[]")
    with caplog.at_level(logging.INFO):
        seconds = supernode.check_site_data(cfg, "A")
    assert seconds >= 0 and "site A: data validated in" in caplog.text
    for mask in (root / "A" / "videos").glob("*/masks/*.png"):
        mask.write_bytes(b"not a png")  # a bad label in every labelled frame of site A
    started = []
    monkeypatch.setattr(supernode, "start", lambda *args, **kwargs: started.append(args))
    monkeypatch.setattr("fedst.training.prepare_data", lambda cfg, progress=False: None)
    with pytest.raises(deploy.DeploymentError) as caught:
        supernode.serve_site(
            cfg, "A", DeployConfig(insecure=True, state_dir=str(tmp_path / "state"))
        )
    message = str(caught.value)
    assert "\n" not in message and "site A: its data under" in message
    assert "python -m fedst.data.check site=A" in message
    assert started == []  # no SuperNode, no ClientApp process
