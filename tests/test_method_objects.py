"""One Method object per process and site (issue 63): an in-process run builds the run's own
method (fedst.runs.Run: the node configs read it too), the server's and one per site's live
Site; the ClientApp keeps the Sites it has built, so a message builds none."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedst.methods import Method
from fedst.training import run_training
from tests.test_federation import experiment, tiny_root  # noqa: F401 (the fixture)


def counted_method_builds(cfg, run_dir: Path) -> int:
    """How many Method objects (any algorithm's: each calls Method.__init__) the in-process
    run of ``cfg`` constructs, its evaluation and final stage included."""
    built = []
    original = Method.__init__

    def counting_init(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Method, "__init__", counting_init)
        run_training(cfg, run_dir, progress=False)
    return len(built)


def test_a_four_site_in_process_round_builds_one_method_per_site_the_server_and_the_run(
    tiny_root,  # noqa: F811 (the fixture imported above)
    tmp_path,
):
    one_round = experiment(
        tiny_root,
        "train.total_iters=1",
        "train.local_iters=1",
        "train.eval_every=1",
        "data.out_of_federation=[]",
        "pretraining.iters=1",
        "serq.batches_per_round=1",
    )
    assert one_round.data.federation == ("A", "B", "C", "D") and one_round.train.rounds == 1
    # the Run (its node configs read run.method), the FederationServer, and 4 Sites
    assert counted_method_builds(one_round, tmp_path / "one") == 1 + 1 + 4
