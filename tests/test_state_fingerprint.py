"""Specification of which settings own a site's private state (fedst/experiment/site_view.py).

* execution settings (compile mode, channels_last, deterministic kernels, require_gpu), the
  unseen-site indicator rule and the server's reply handling (``fed.*``) do not change the state
  fingerprint: a run resumes with others;
* a state folder written before those fields existed (``train.compile`` a bool, no
  channels_last, deterministic, require_gpu or indicator.unseen) is still claimed by the same
  configuration;
* a setting that changes what a site learns (the learning rate) is still refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from fedst.experiment import site_view, state_fingerprint
from fedst.federation.site import StateMismatchError, claim_state_dir
from fedst.runs.layout import STATE_FINGERPRINT
from tests.test_federation import experiment


def _train(cfg, **changes):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def values_before_roles(cfg) -> dict:
    """A site view's values that the code before issue 63 fingerprinted (its lists: the
    evaluation and execution fields, the selection rule and metric, method.returned_model,
    indicator.unseen and the fed section left out)."""
    values = json.loads(site_view(cfg).to_json())
    for key in ("eval_every", "eval_max_frames", "val_every", "eval_batch_size"):
        values["train"].pop(key)
    for key in ("distance_metrics_every", "checkpoint_every"):
        values["train"].pop(key)
    for key in ("rule", "metric"):
        values["selection"].pop(key)
    values["method"].pop("returned_model")
    for key in ("compile", "channels_last", "deterministic", "require_gpu"):
        values["train"].pop(key)
    values["indicator"].pop("unseen")
    values.pop("fed")  # the server's reply handling (issue 45)
    values["data"].pop("cache_dir")  # the frame cache (issue 60): later, of role execution
    return values


def digest(values: dict) -> str:
    return hashlib.sha1(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]


def old_format_fingerprint(cfg) -> str:
    """The fingerprint as runs recorded it before issue 33 and 37 (by the rule of that code:
    no execution fields, ``train.compile`` a bool)."""
    values = values_before_roles(cfg)
    values["train"]["compile"] = False
    return digest(values)


def test_execution_settings_the_unseen_rule_and_reply_handling_leave_the_fingerprint(tmp_path):
    cfg = experiment(tmp_path)
    changed = _train(cfg, compile="reduce-overhead", channels_last=True, deterministic=False)
    changed = dataclasses.replace(
        changed,
        indicator=dataclasses.replace(changed.indicator, unseen="mean"),
        fed=dataclasses.replace(changed.fed, max_update_ratio=10.0, trim_fraction=0.2),
    )
    assert state_fingerprint(site_view(changed)) == state_fingerprint(site_view(cfg))
    assert state_fingerprint(site_view(_train(cfg, lr=cfg.train.lr * 2))) != state_fingerprint(
        site_view(cfg)
    )


def test_a_state_folder_from_before_the_execution_fields_is_claimed_by_the_same_config(tmp_path):
    cfg = _train(experiment(tmp_path), compile="none")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    record = {"fingerprint": old_format_fingerprint(cfg), "site": "A", "config": {}}
    (state_dir / STATE_FINGERPRINT).write_text(json.dumps(record))
    claim_state_dir(state_dir, "A", cfg)  # no StateMismatchError
    with pytest.raises(StateMismatchError, match="site A"):
        claim_state_dir(state_dir, "A", _train(cfg, lr=cfg.train.lr * 2))
