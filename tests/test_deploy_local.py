"""A site and ``python -m fedst.deploy local`` before anything connects (issue 33, item 6):

* the documented ``local --sites A B C D experiment=tiny`` reaches four sites and one override;
* each local site process gets its own GPU (CUDA_VISIBLE_DEVICES) round-robin over the visible
  ones when there are several, respecting an existing CUDA_VISIBLE_DEVICES list;
* a site validates its whole dataset before its SuperNode starts: a bad file is one line naming
  the fix, and the time it took is logged.

No process is started: fedst.deploy's ``start`` is replaced by a recorder.
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


def test_local_removes_its_temporary_work_folder_and_keeps_a_named_one(
    tiny_root, tmp_path, monkeypatch
):
    """Issue 46: each run left its work folder (499 MB after a tiny run) in the temp folder."""

    class Finished:
        def wait(self) -> int:
            return 0

    def record(command, log_path, env, new_group=True):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.touch()
        return Finished()

    monkeypatch.setattr(local, "start", record)
    monkeypatch.setattr(local, "stop", lambda process, grace=10.0: None)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    overrides = ["experiment=tiny", f"data.root={tiny_root}"]
    assert local.local(["A", "B"], overrides) == 0
    assert list(temp.iterdir()) == []
    assert local.local(["A", "B"], overrides, tmp_path / "kept") == 0
    assert (tmp_path / "kept" / "certs" / "ca.crt").is_file() and list(temp.iterdir()) == []


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
