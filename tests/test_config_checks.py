"""Config values are type- and range-checked when the experiment is built, naming key and values."""

from __future__ import annotations

import pytest

from fedst.cli import compose_experiment
from fedst.config import ConfigError

BAD_VALUES = [
    # (override, key the message must name, accepted values it must state)
    ("train.rounds=abc", "train.rounds", "integer"),
    ("train.lr=abc", "train.lr", "number"),
    ("seed=abc", "seed", "integer"),
    ("train.local_iters=0", "train.local_iters", ">= 1"),
    ("train.local_iters=abc", "train.local_iters", "integers"),
    ("train.batch_size=0", "train.batch_size", ">= 1"),
    ("train.eval_every=0", "train.eval_every", ">= 1"),
    ("train.eval_max_frames=0", "train.eval_max_frames", ">= 1"),
    ("train.lr=0", "train.lr", "> 0"),
    ("seed=-1", "seed", ">= 0"),
    ("serq.batch_size=0", "serq.batch_size", ">= 1"),
    ("method.serq=maybe", "method.serq", "true or false"),
    ("clip.image_size=[64]", "clip.image_size", "2 values"),
    ("data.federation=[]", "data.federation", "at least one site"),
    ("data.federation=[A,A]", "data.federation", "more than once"),
]


@pytest.mark.parametrize(("override", "key", "accepted"), BAD_VALUES)
def test_a_bad_value_is_a_config_error_naming_the_key_and_what_is_accepted(override, key, accepted):
    with pytest.raises(ConfigError) as caught:
        compose_experiment(["experiment=tiny", override])
    message = str(caught.value)
    assert key in message and accepted in message, message


def test_good_values_of_every_type_still_build():
    cfg, _ = compose_experiment(
        [
            "experiment=tiny",
            "train.lr=1e-4",
            "train.eval_max_frames=null",
            "train.max_grad_norm=1",
            "clip.image_size=[32,40]",
            "network.pretrained=false",
            "data.federation=[A,B]",
        ]
    )
    assert cfg.train.lr == 1e-4 and cfg.train.eval_max_frames is None
    assert cfg.clip.image_size == (32, 40) and cfg.data.federation == ("A", "B")
