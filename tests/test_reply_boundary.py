"""Specifications of the reply boundary (issue 59): nothing a site sends can crash the server or
steer the average.

Through the real ServerApp loop (``run_federation`` over the in-process Grid, the path every
engine shares through ``SiteGrid.ask``): stand-in sites A, B, C add 1, 2 and 4 to every shared
value they receive and report 1, 3 and 2 training samples; C sends a faulty reply in round 2.
Expected aggregates are derived by hand from those numbers:

* every reply averaged, uniform weights: +7/3 per round;
* C refused in round 2: +7/3 then +(1 + 2)/2 = +3/2 (samples: +15/6, then +(1 + 3 x 2)/4 = +7/4).

The holes, each checked on the code before the fix: a site's own weight was read (10^6 took the
average, NaN crashed the server); one more metric key stopped the run (Flower's
``InconsistentMessageReplies``), so a GPU site beside CPU sites could not take part; an int64
gamma_k and a 1e30 gamma_k were averaged; a round named ``two`` raised ``ValueError``; a data
size re-declared as 10^9 took the whole sample-weighted average; an aggregate the server had not
checked was stored and sent.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedst.app.messaging import FederationError
from fedst.experiment import RoundPolicy
from fedst.federation import transport
from fedst.federation.server import SERVER_CHECKPOINT
from fedst.methods.base import Method
from fedst.storage import read_jsonl
from tests import test_reply_checks as checks_tests
from tests.test_federation import tiny_root  # noqa: F401  (the fixture)
from tests.test_reply_checks import DELTAS, SAMPLES, federate_with

assert DELTAS == {"A": 1.0, "B": 2.0, "C": 4.0} and SAMPLES == {"A": 1, "B": 3, "C": 2}  # as above
ALL_AVERAGED = 7 / 3 + 7 / 3
"""Uniform weights, nobody refused: (1 + 2 + 4) / 3 in each of the two rounds."""
C_REFUSED_IN_ROUND_2 = 7 / 3 + 3 / 2
C_REFUSED_IN_ROUND_2_SAMPLES = 15 / 6 + 7 / 4

Fault = Callable[[str, int, dict, dict, dict], dict]
"""(site, round, gamma_k, metrics, site record) -> gamma_k as sent; may edit metrics and record."""


def stand_in_sites(shared: list[str], fault: Fault | None):
    """The honest stand-ins of tests/test_reply_checks.py (site k: gamma_k = received + DELTAS[k],
    n_k = SAMPLES[k], "uniform-weight": 1 as the sites before issue 59 sent it); ``fault`` then
    changes any site's train reply in any round: its gamma_k, metrics and "site" record."""
    honest = checks_tests.stand_in_sites(shared, None)

    def reply(message: Message, context) -> Message:
        answer = honest(message, context)
        if fault is None or message.metadata.message_type != MessageType.TRAIN:
            return answer
        site = "ABC"[message.metadata.dst_node_id - 1]
        server_round = int(message.content["config"]["server-round"])
        metrics, record = dict(answer.content["metrics"]), dict(answer.content["site"])
        gamma = fault(site, server_round, transport.unpack(answer.content), metrics, record)
        packed = transport.pack(gamma, "fp32").records()
        content = {**packed, "metrics": MetricRecord(metrics), "site": ConfigRecord(record)}
        return Message(RecordDict(content), reply_to=message)

    return reply


def federate(root: Path, run_dir: Path, fault: Fault | None, *overrides: str):
    """Two rounds of A, B, C (tests/test_reply_checks.py); returns gamma_g^0."""
    sites_of = lambda shared: stand_in_sites(shared, fault)  # noqa: E731
    return federate_with(root, run_dir, sites_of, RoundPolicy(min_sites=2), *overrides)


def assert_global_model_moved_by(run_dir: Path, initial: dict, expected: float) -> None:
    global_model = torch.load(run_dir / SERVER_CHECKPOINT, weights_only=False)["global_model"]
    for key, value in initial.items():
        torch.testing.assert_close(global_model[key], value + expected, msg=key)


def in_round_2_at_c(change: Callable[[dict, dict, dict], dict | None]) -> Fault:
    """A fault of site C in round 2: ``change(gamma, metrics, record)`` (None: gamma unchanged)."""

    def fault(site, server_round, gamma, metrics, record):
        if site == "C" and server_round == 2:
            return change(gamma, metrics, record) or gamma
        return gamma

    return fault


# -- item 1: the server computes every weight ----------------------------------------------------


@pytest.mark.parametrize("weight", [1e6, math.nan])
def test_a_weight_sent_by_a_site_is_never_read(tiny_root, tmp_path, weight):  # noqa: F811
    """Before: 10^6 made the aggregate C's gamma_k; NaN crashed the server (WireValueError)."""
    fault = in_round_2_at_c(
        lambda gamma, metrics, record: metrics.update({"uniform-weight": weight})
    )
    initial = federate(tiny_root, tmp_path / "run", fault)
    assert_global_model_moved_by(tmp_path / "run", initial, ALL_AVERAGED)


# -- item 2 and 4: one schema; extra keys dropped; a mixed fleet --------------------------------


def test_a_mixed_fleet_finishes_with_every_sites_figures_in_train_jsonl(
    tiny_root,  # noqa: F811
    tmp_path,
    caplog,
):
    """C computes on a GPU (its replies carry the CUDA peaks), A and B on CPUs; C also sends a
    key no FedST version writes. Before: InconsistentMessageReplies ended the run."""

    def gpu_site(site, server_round, gamma, metrics, record):
        if site == "C":
            metrics.update(
                {
                    "cuda-peak-allocated-bytes": 1000 * server_round,
                    "cuda-peak-reserved-bytes": 2000 * server_round,
                    "a-key-of-the-future": 1.5,
                }
            )
        return gamma

    with caplog.at_level(logging.WARNING):
        initial = federate(tiny_root, tmp_path / "run", gpu_site)
    assert_global_model_moved_by(tmp_path / "run", initial, ALL_AVERAGED)
    rows = [r for r in read_jsonl(tmp_path / "run" / "train.jsonl") if r["site"] in "ABC"]
    assert sorted((r["round"], r["site"]) for r in rows) == [(n, s) for n in (1, 2) for s in "ABC"]
    for row in rows:
        gpu = row["site"] == "C"
        assert row.get("cuda_peak_allocated_bytes") == (1000 * row["round"] if gpu else None)
        assert row.get("cuda_peak_reserved_bytes") == (2000 * row["round"] if gpu else None)
        assert "a-key-of-the-future" not in row and "a_key_of_the_future" not in row
    dropped = [r.getMessage() for r in caplog.records if "a-key-of-the-future" in r.getMessage()]
    assert len(dropped) == 1, dropped  # once per site, not once per round
    assert "site C" in dropped[0] and "dropped" in dropped[0]


def _int64(gamma, metrics, record):
    return {k: v.round().to(torch.int64) for k, v in gamma.items()}


def _huge(gamma, metrics, record):
    return {k: torch.full_like(v, 1e30) for k, v in gamma.items()}


def _round_as_text(gamma, metrics, record):
    record["round"] = "two"


def _data_size_as_text(gamma, metrics, record):
    record["data-size"] = "many"


def _loader_seconds_as_list(gamma, metrics, record):
    metrics["loader-seconds"] = [0.5, 0.5]


def _no_sample_count(gamma, metrics, record):
    del metrics["num-examples"]


def _redeclared_data_size(gamma, metrics, record):
    metrics["num-examples"] = 10**9
    record["data-size"] = 10**9
    record["data-changed"] = 1


REFUSED = {  # fault -> (change, overrides, check, words of the reason)
    "int64": (_int64, [], "dtype", "int64 (server: float32)"),
    "huge": (_huge, [], "magnitude", "beyond the bound"),
    "round-text": (_round_as_text, [], "schema", "'round'"),
    "data-size-text": (_data_size_as_text, [], "schema", "'data-size'"),
    "seconds-list": (_loader_seconds_as_list, [], "schema", "'loader-seconds'"),
    "no-samples": (_no_sample_count, [], "schema", "lacks 'num-examples'"),
    "data-size-1e9": (
        _redeclared_data_size,
        ["method.aggregation_weights=samples"],
        "samples",
        "beyond fed.max_data_change=2",
    ),
}


@pytest.mark.parametrize("fault", sorted(REFUSED))
def test_a_reply_outside_the_schema_is_refused_naming_the_check(
    tiny_root,  # noqa: F811
    tmp_path,
    fault,
):
    change, overrides, check, words = REFUSED[fault]
    initial = federate(tiny_root, tmp_path / "run", in_round_2_at_c(change), *overrides)
    samples = "method.aggregation_weights=samples" in overrides
    expected = C_REFUSED_IN_ROUND_2_SAMPLES if samples else C_REFUSED_IN_ROUND_2
    assert_global_model_moved_by(tmp_path / "run", initial, expected)
    refused = [r for r in read_jsonl(tmp_path / "run" / "train.jsonl") if "refused" in r]
    assert [(r["round"], r["site"], r["refused"]) for r in refused] == [(2, "C", check)]
    assert words in refused[0]["reason"], refused[0]["reason"]


# -- item 2: the server checks its own aggregate ------------------------------------------------


def test_an_aggregate_beyond_the_bound_stops_the_run_naming_the_sites_averaged(
    tiny_root,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """A broken aggregation rule (here: one that overflows in round 2) is never stored or sent.
    Before: the server stored it and died packing it for the evaluation (WireValueError)."""
    honest = Method.aggregate

    def overflowing(self, server_round, replies, current):
        aggregated = honest(self, server_round, replies, current)
        if server_round == 2:
            key = next(iter(aggregated))
            aggregated[key] = aggregated[key] * math.inf
        return aggregated

    monkeypatch.setattr(Method, "aggregate", overflowing)
    with pytest.raises(FederationError) as caught:
        federate(tiny_root, tmp_path / "run", None)
    line = str(caught.value)
    assert "\n" not in line and "round 2" in line and "sites A, B, C" in line, line
    assert "aggregate" in line and "NaN or inf" in line, line
    kept = torch.load(tmp_path / "run" / SERVER_CHECKPOINT, weights_only=False)
    assert kept["round"] == 1  # round 2's aggregate was neither stored nor sent


# -- item 7: the schema's table in docs/deployment.md ----------------------------------------------


def test_the_reply_schema_table_of_the_deployment_guide_names_every_field():
    from fedst.app.reply_schema import reply_schemas
    from fedst.methods.fedas import FedAS

    guide = (Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text()
    table = guide.split("### Reply schema", 1)[1].split("\n\n| message |", 1)[1].split("\n\n")[0]
    documented = set(re.findall(r"`([^`]+)`", table))
    fields = {
        rule.key
        for schema in reply_schemas(FedAS.reply_scalars).values()
        for record in (schema.site, schema.metrics)
        for rule in (*record.required, *record.optional, *(r for _, r in record.patterned))
    }
    assert fields - documented == set(), fields - documented


# -- item 1: weights and the declared scalar, table-driven ----------------------------------------


def test_the_server_computes_each_weight_from_what_it_checked():
    from fedst.federation.reply_checks import ReplyChecker, Update
    from fedst.methods.fedas import FedAS
    from fedst.methods.reply_keys import NUM_EXAMPLES

    reference = {"w": torch.zeros(2)}
    fisher = FedAS.reply_scalars[0]  # "fisher-trace", > 0, within 1000 x the median

    def update(n: int, trace: float) -> Update:
        return Update({"w": torch.ones(2)}, n, n, declared={fisher.key: trace})

    updates = {"A": update(1, 2.0), "B": update(3, 6.0), "C": update(2, 4.0)}
    by_hand = {  # uniform 1/3; samples n_k / 6; fisher F_k / 12
        None: {"A": 1 / 3, "B": 1 / 3, "C": 1 / 3},
        NUM_EXAMPLES: {"A": 1 / 6, "B": 3 / 6, "C": 2 / 6},
        fisher.key: {"A": 2 / 12, "B": 6 / 12, "C": 4 / 12},
    }
    for weight_by, expected in by_hand.items():
        checker = ReplyChecker(weight_by=weight_by, declared=(fisher,))
        refusals, _ = checker.check(updates, reference)
        assert refusals == {}
        assert checker.weights(updates) == pytest.approx(expected)
    # traces 2, 6 and C's: beyond 1000 x the round's median either way is refused; C above 6
    # makes the median 6 (limit 6000), C below 2 makes it 2 (limit 0.002)
    for outlier, median, refused in ((6001.0, 6, True), (5999.0, 6, False), (0.0019, 2, True)):
        checker = ReplyChecker(weight_by=fisher.key, declared=(fisher,))
        refusals, _ = checker.check({**updates, "C": update(2, outlier)}, reference)
        assert list(refusals) == (["C"] if refused else [])
        if refused:
            assert refusals["C"].check == "weight"
            assert f"beyond 1000 x the round's median {median} " in refusals["C"].reason
    assert fisher.problem(0.0) == "'fisher-trace' is 0, outside the rule: a finite number > 0, " + (
        "within 1000 x the round's median either way"
    )
    assert "not a finite number" in fisher.problem(math.nan)


def test_the_magnitude_bound_is_the_square_root_of_float32s_largest_or_the_wire_limit():
    from fedst.federation.reply_checks import inspect_update, magnitude_bound

    # sqrt((2 - 2^-23) x 2^127) = 2^64 (to 1e-7); fp16's largest finite value is 65504
    assert magnitude_bound("fp32") == pytest.approx(2.0**64, rel=1e-6)
    assert magnitude_bound("bf16") == pytest.approx(2.0**64, rel=1e-6)
    assert magnitude_bound("fp16") == 65504
    reference = {"w": torch.zeros(3), "b": torch.ones(2)}
    for value, precision, refused in (
        (1e19, "fp32", False),
        (2e19, "fp32", True),
        (65504.0, "fp16", False),
        (7e4, "fp16", True),
    ):
        state = {"w": torch.tensor([0.0, value, 0.0]), "b": torch.ones(2)}
        problem, _ = inspect_update(state, reference, magnitude_bound(precision))
        assert (problem is not None and problem[0] == "magnitude") == refused, (value, problem)


def test_an_evaluate_reply_carries_its_scores_in_percent_and_the_schema_takes_them(monkeypatch):
    """A site's evaluate metrics come from SegmentationMeter.summary, in percent: a perfect
    prediction scores 100 on every overlap metric (Dice, IoU and the EndoVis IoUs) and the
    server's schema accepts it; a score above 100 is refused. (The schema first bounded Dice and
    IoU by 1: the first trained site above 1 % Dice was refused and the tiny run stopped.)"""
    from fedst.app.client_app import evaluation_metrics
    from fedst.app.reply_schema import reply_schemas, screen
    from fedst.scoring.metrics import SegmentationMeter

    truth = torch.zeros(2, 8, 8, dtype=torch.long)
    truth[:, 2:5, 2:6] = 1
    truth[:, 5:7, 1:3] = 3
    meter = SegmentationMeter(distances=False)
    meter.update(truth.clone(), truth)
    metrics = evaluation_metrics(meter.summary())
    for name in ("dice", "iou", "challenge_iou", "isi_iou", "mciou"):
        assert metrics[name] == pytest.approx(100.0)
    schema = reply_schemas()[MessageType.EVALUATE]
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # a Message outside a run needs these
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)

    def reply(scores: dict) -> Message:  # screen() reads the content only
        content = {"site": ConfigRecord({"site": "A", "round": 1}), "metrics": MetricRecord(scores)}
        return Message(RecordDict(content), dst_node_id=1, message_type=MessageType.EVALUATE)

    assert screen(reply(metrics), schema).problem is None
    assert "dice" in (screen(reply({**metrics, "dice": 100.5}), schema).problem or "")
