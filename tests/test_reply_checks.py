"""Specifications of the server's reply checks (issue 45; fedst/federation/reply_checks.py):
a faulty site cannot spoil the federation.

* the checks alone, on hand-made states (no Flower): keys, shapes, finite values, sample counts,
  the norm rule, round and site;
* fault injection in-process through the real ServerApp loop (``run_federation`` over the
  in-process Grid, the path every engine shares through ``SiteGrid.ask``): three stand-in sites
  A, B, C add a constant to every shared value they receive; C misbehaves in round 2. The run
  goes on without C's reply (``deploy.min_sites=2``), the server's gamma_g equals the hand
  average of A's and B's replies, and train.jsonl / participation.jsonl / final.json name C and
  the check; with every site required the run stops with one line naming C and the check.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, Message, MessageType, MetricRecord, RecordDict

from fedst.app import server_app
from fedst.app.inprocess import InProcessGrid
from fedst.app.messaging import FederationError, SiteGrid, site_of
from fedst.experiment import RoundPolicy
from fedst.federation import transport
from fedst.federation.reply_checks import (
    ReplyChecker,
    Update,
    identity_problem,
    norm_problems,
    samples_problem,
    tensor_problem,
)
from fedst.federation.server import SERVER_CHECKPOINT
from fedst.federation.site import NonFiniteUpdateError, Site
from fedst.methods import method_of
from fedst.runs.files import RunLog
from fedst.runs.final import refused_replies
from fedst.storage import read_jsonl
from tests.conftest import site_record, stand_in_reply
from tests.test_federation import experiment, tiny_root  # noqa: F401  (the fixture)

REFERENCE = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}


def state(w: float = 1.0, b: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), w), "b": torch.full((3,), b)}


# -- the checks alone --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "check", "named"),
    [
        ({"w": torch.zeros(2, 3)}, "keys", "lacks 1 shared tensor(s), e.g. ['b']"),
        ({**state(), "q": torch.zeros(1)}, "keys", "has 1 the server does not share"),
        ({**state(), "b": torch.zeros(4)}, "shapes", "b [4] (server: [3])"),
        ({**state(), "w": torch.full((2, 3), math.nan)}, "finite", "e.g. ['w']"),
        ({**state(), "b": torch.tensor([0.0, math.inf, 0.0])}, "finite", "e.g. ['b']"),
    ],
)
def test_a_reply_that_is_not_the_servers_shared_parameters_with_finite_values_is_refused(
    reply, check, named
):
    problem = tensor_problem(reply, REFERENCE)
    assert problem is not None and problem[0] == check and named in problem[1]
    assert tensor_problem(state(), REFERENCE) is None


@pytest.mark.parametrize(
    ("update", "first", "refused"),
    [
        (Update(state(), 120, 120), None, None),
        (Update(state(), 1e9, 120), None, "n_k = 1e+09 samples, outside [1, its data size 120]"),
        (Update(state(), 0, 120), None, "outside [1"),
        (Update(state(), 2.5, 120), None, "outside [1"),
        (Update(state(), 1e9, 10**9), 120, "size of 1000000000, 120 in its previous accepted"),
        (Update(state(), 150, 150, data_changed=True), 120, None),
        (Update(state(), 1, None), None, "reports no data size"),
    ],
)
def test_a_sample_count_must_lie_within_the_data_size_the_site_reported_first(
    update, first, refused
):
    reason = samples_problem(update, first)
    assert (reason is None) if refused is None else (refused in reason)


def test_the_checker_keeps_each_sites_first_data_size_and_accepts_a_declared_change():
    checker = ReplyChecker()
    refusals, _ = checker.check({"A": Update(state(), 100, 100)}, REFERENCE)
    assert refusals == {} and checker.data_sizes == {"A": 100}
    refusals, _ = checker.check({"A": Update(state(), 10**9, 10**9)}, REFERENCE)
    assert refusals["A"].check == "samples" and checker.data_sizes == {"A": 100}
    refusals, _ = checker.check({"A": Update(state(), 150, 150, data_changed=True)}, REFERENCE)
    assert refusals == {} and checker.data_sizes == {"A": 150}


def test_the_norm_rule_refuses_an_update_beyond_r_times_the_rounds_median_and_is_off_by_default():
    # updates against the zero reference: ||w||, b zero -> norms sqrt(6) x (1, 2, 200)
    updates = {
        "A": Update(state(1.0, 0.0), 1, 1),
        "B": Update(state(2.0, 0.0), 1, 1),
        "C": Update(state(200.0, 0.0), 1, 1),
    }
    refusals, norms = ReplyChecker(max_update_ratio=10).check(updates, REFERENCE)
    assert norms == pytest.approx(
        {s: math.sqrt(6) * f for s, f in zip("ABC", (1, 2, 200), strict=True)}
    )
    assert list(refusals) == ["C"] and refusals["C"].check == "norm"
    assert "exceeds fed.max_update_ratio=10 x the round's median 4.899" in refusals["C"].reason
    assert ReplyChecker().check(updates, REFERENCE)[0] == {}  # off: nothing refused
    # two sites: no norm exceeds twice their median (their mean), so R >= 2 refuses nothing
    assert norm_problems({"A": 1.0, "B": 1000.0}, 2.0) == {}


@pytest.mark.parametrize(
    ("site", "declared", "known", "problem"),
    [
        ("A", 3, None, None),
        ("A", 3, "A", None),
        ("A", 2, "A", ("round", "it answers round 2, the step asked round 3")),
        ("A", None, "A", ("round", "it names no round")),
        ("Z", 3, None, ("site", "it says it is site 'Z', which is not in the federation")),
        ("B", 3, "A", ("site", "it says it is site B, its node answered as site A before")),
    ],
)
def test_a_reply_must_answer_the_round_asked_as_the_site_its_node_is(
    site, declared, known, problem
):
    found = identity_problem(site, declared, 3, ["A", "B"], known)
    assert found == problem or (
        found is not None and found[0] == problem[0] and found[1].startswith(problem[1])
    )


# -- the site's own side ------------------------------------------------------------------------


def test_fp16_transport_refuses_a_value_beyond_its_range_naming_the_tensor():
    ok = transport.pack({"w": torch.tensor([65504.0, -65504.0])}, "fp16")
    assert transport.unpack(RecordDict(ok.records()))["w"].tolist() == [65504.0, -65504.0]
    with pytest.raises(transport.WireValueError, match=r"tensor big holds values up to .*70000"):
        transport.pack({"w": torch.zeros(2), "big": torch.tensor([1.0, 7e4])}, "fp16")
    assert transport.pack({"big": torch.tensor([7e4])}, "bf16").param_bytes == 2  # in range


def test_no_non_finite_value_is_ever_packed():
    for precision in ("fp32", "fp16", "bf16"):
        with pytest.raises(transport.WireValueError, match="tensor b holds NaN or inf"):
            transport.pack({"w": torch.ones(2), "b": torch.tensor([math.nan])}, precision)


def test_a_site_whose_shared_parameters_became_non_finite_sends_and_saves_nothing(
    tiny_root,  # noqa: F811
    tmp_path,
):
    """The loss stayed finite but a step left inf in a shared tensor (e.g. an fp16 overflow):
    the round stops naming the tensor, before the state of the round is written."""
    cfg = experiment(tiny_root)
    site = Site("A", cfg, tmp_path, torch.device("cpu"))
    key = site.partition.shared[0]
    original = site.train_phase

    def overflowing_phase(phase, server_round, *args, **kwargs):
        losses = original(phase, server_round, *args, **kwargs)
        with torch.no_grad():
            site.model.get_parameter(key).view(-1)[0] = math.inf
        return losses

    site.train_phase = overflowing_phase
    full = {k: v.clone() for k, v in method_of(cfg).build_model().state_dict().items()}
    with pytest.raises(NonFiniteUpdateError, match=rf"site A: 1 shared parameter\(s\) .*'{key}'"):
        site.train_round(full, server_round=1, local_iters=1)
    assert not (tmp_path / "state_r0001.pt").exists()


# -- fault injection through the ServerApp loop ------------------------------------------------------

DELTAS = {"A": 1.0, "B": 2.0, "C": 4.0}
"""What each stand-in site adds to every shared value it receives."""
SAMPLES = {"A": 1, "B": 3, "C": 2}
"""Each stand-in site's training-set size, reported as n_k."""


def stand_in_sites(shared: list[str], fault: str | None):
    """A ClientApp stand-in: site k replies gamma_k = received + DELTAS[k] in every shared tensor;
    C misbehaves in round 2 with ``fault``."""

    def reply(message: Message, context) -> Message:
        site = "ABC"[message.metadata.dst_node_id - 1]
        server_round = int(message.content["config"]["server-round"])
        metrics: dict = {"num-examples": SAMPLES[site], "uniform-weight": 1}
        record = site_record(site, message, data_size=SAMPLES[site])
        content: dict = {"site": record}
        if message.metadata.message_type == MessageType.TRAIN:
            received = transport.unpack(message.content)
            faulty = site == "C" and server_round == 2
            delta = DELTAS[site] * (100 if faulty and fault == "norm" else 1)
            gamma = {k: received[k] + delta for k in shared}
            if faulty and fault == "keys":
                del gamma[shared[0]]
            if faulty and fault == "shapes":  # one element more in a 1-D tensor
                key = next(k for k in shared if gamma[k].dim() == 1)
                gamma[key] = torch.cat([gamma[key], gamma[key][:1]])
            packed = transport.pack(gamma, "fp32")
            if faulty and fault == "finite":  # past the site's own guard, as a broken site would
                values = packed.buffers["float32"].numpy().copy()
                values[7] = np.nan
                packed.buffers["float32"] = Array(values)
            if faulty and fault == "samples":
                metrics["num-examples"] = 10**9
            if faulty and fault == "round":  # an answer to the previous round's instruction
                record["round"] = server_round - 1
            if faulty and fault == "site":  # C's node answers as A
                record["site"] = "A"
            if not (faulty and fault == "wire"):  # a train reply without gamma_k
                content.update(packed.records())
        return stand_in_reply(message, content, metrics)

    return reply


FAULTS = {  # fault -> (overrides, the reason's words in the log)
    "finite": ([], "hold NaN or inf values"),
    "shapes": ([], "tensor(s) of another shape"),
    "keys": ([], "lacks 1 shared tensor(s)"),
    "norm": (["fed.max_update_ratio=10"], "exceeds fed.max_update_ratio=10"),
    "samples": (["method.aggregation_weights=samples"], "claims n_k = 1e+09 samples"),
    "round": ([], "it answers round 1, the step asked round 2"),
    "site": ([], "it says it is site A, its node answered as site C before"),
    "wire": ([], "the message has no record 'arrays'"),
}


def federate(root: Path, run_dir: Path, fault: str | None, policy: RoundPolicy, *overrides: str):
    """Two rounds of A, B, C (C faulty in round 2); returns gamma_g^0 (the round-1 download)."""
    return federate_with(
        root, run_dir, lambda shared: stand_in_sites(shared, fault), policy, *overrides
    )


def federate_with(root: Path, run_dir: Path, sites_of, policy: RoundPolicy, *overrides: str):
    """The two rounds of FedAvg (uniform weights, no pre-training) of A, B, C, answered by the
    ClientApp stand-in ``sites_of(shared keys)``; returns gamma_g^0 (the round-1 download)."""
    cfg = experiment(
        root,
        "method=fedavg",
        "method.aggregation_weights=uniform",
        "method.synthetic_pretraining=false",
        "data.federation=[A,B,C]",
        "data.out_of_federation=[]",
        *overrides,
    )
    assert cfg.train.rounds == 2
    model = method_of(cfg).build_model()
    shared = list(method_of(cfg).partition(model).shared)
    downloads: list[Message] = []

    def keep_first_download(direction: str, message: Message) -> None:
        if direction == "down" and message.metadata.message_type == "train" and not downloads:
            downloads.append(message)

    grid = InProcessGrid(sites_of(shared), [{}, {}, {}], observer=keep_first_download)
    server_app.run_federation(grid, cfg, run_dir, progress=False, policy=policy)
    initial = transport.unpack(downloads[0].content)
    return {k: initial[k] for k in shared}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_faulty_reply_is_left_out_of_the_round_and_logged_with_its_site_and_check(
    tiny_root,  # noqa: F811
    tmp_path,
    fault,
):
    overrides, words = FAULTS[fault]
    run_dir = tmp_path / "run"
    policy = RoundPolicy(min_sites=2, audit=True)
    initial = federate(tiny_root, run_dir, fault, policy, *overrides)
    # by hand: round 1 averages every site's delta, round 2 those of A and B only
    # weights n_k (samples): (1 x 1 + 3 x 2 + 2 x 4) / 6, then (1 x 1 + 3 x 2) / 4;
    # uniform: (1 + 2 + 4) / 3, then (1 + 2) / 2
    expected = 15 / 6 + 7 / 4 if fault == "samples" else 7 / 3 + 3 / 2
    global_model = torch.load(run_dir / SERVER_CHECKPOINT, weights_only=False)["global_model"]
    for key, value in initial.items():
        torch.testing.assert_close(global_model[key], value + expected, msg=key)
    refused = [r for r in read_jsonl(run_dir / "train.jsonl") if "refused" in r]
    assert [(r["round"], r["site"], r["step"], r["refused"]) for r in refused] == [
        (2, "C", "train", fault)
    ]
    assert words in refused[0]["reason"]
    wire = [r for r in read_jsonl(run_dir / "wire.jsonl") if "refused" in r]
    assert [(r["round"], r["site"], r["refused"]) for r in wire] == [(2, "C", fault)]
    participation = read_jsonl(run_dir / "participation.jsonl")
    assert [r["missing"] for r in participation] == [[], ["C"]]
    counted = refused_replies(read_jsonl(run_dir / "train.jsonl"))  # final.json's entry
    assert (counted["count"], counted["by_check"], counted["by_site"]) == (1, {fault: 1}, {"C": 1})


def test_without_a_fault_every_reply_is_averaged(tiny_root, tmp_path):  # noqa: F811
    """The control of the test above: the same sites, nobody refused, C's delta averaged in."""
    run_dir = tmp_path / "run"
    initial = federate(tiny_root, run_dir, None, RoundPolicy(min_sites=2))
    global_model = torch.load(run_dir / SERVER_CHECKPOINT, weights_only=False)["global_model"]
    for key, value in initial.items():
        torch.testing.assert_close(global_model[key], value + 7 / 3 + 7 / 3, msg=key)
    assert refused_replies(read_jsonl(run_dir / "train.jsonl"))["count"] == 0


def test_a_refused_reply_below_min_sites_stops_the_run_naming_the_site_and_the_check(
    tiny_root,  # noqa: F811
    tmp_path,
):
    with pytest.raises(FederationError, match=r"C: reply refused \(finite check\): 1 tensor"):
        federate(tiny_root, tmp_path / "run", "finite", RoundPolicy())


class RepeatingGrid(InProcessGrid):
    """Delivers every reply twice, and one reply to a message of no step (as a confused link
    might): neither may reach the aggregation."""

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        stray = copy.deepcopy(next(r for r in replies if site_of(r) == "A"))
        stray.metadata.__dict__["_reply_to_message_id"] = "a message of another step"
        return [*replies, *replies, stray]


def test_a_second_answer_to_a_message_or_an_answer_to_no_message_is_refused(tmp_path):
    def toy_site(message: Message, context) -> Message:
        site = "AB"[message.metadata.dst_node_id - 1]
        content = transport.pack({"w": torch.full((2,), 1.0 + (site == "B"))}, "fp32").records()
        return Message(
            RecordDict(
                {
                    **content,
                    "site": site_record(site, message, data_size=1),
                    "metrics": MetricRecord({"num-examples": 1, "train-loss": 0.5, "seconds": 0.0}),
                }
            ),
            reply_to=message,
        )

    grid = RepeatingGrid(toy_site, [{}, {}])
    runlog = RunLog(tmp_path, tensorboard=False)
    sites = SiteGrid(grid, ["A", "B"], RoundPolicy(), runlog=runlog)
    sites.connect()
    reference = {"w": torch.zeros(2)}
    down = transport.pack(reference, "fp32")
    replies = sites.ask("train", down, {"server-round": 1}, 1, "train", reference=reference)
    assert [site_of(r) for r in replies.replies] == ["A", "B"] and replies.failed == {}
    assert sorted((r.site, r.check, r.reason) for r in replies.refused) == [
        ("A", "round", "it answers a message a second time"),
        ("A", "round", "it answers no message of this step"),
        ("B", "round", "it answers a message a second time"),
    ]
    assert replies.states["B"]["w"].tolist() == [2.0, 2.0]
    rows = [r for r in read_jsonl(tmp_path / "train.jsonl") if "refused" in r]
    assert len(rows) == 3
