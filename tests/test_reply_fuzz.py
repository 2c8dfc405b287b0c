"""A fuzz test of the reply boundary (issue 59, item 5): from a valid train reply and a valid
evaluate reply, hypothesis generates mutations (keys dropped, added or renamed; wrong types;
NaN, inf, huge, negative and zero scalars; text where numbers go; tensors of another dtype or
shape, or with NaN / huge values; empty or missing records; a record of another type; a reply
delivered twice). The server's reply handling (``SiteGrid.ask``, then what the ServerApp reads of
an accepted reply: its train.jsonl and comm.jsonl rows, the view its strategy averages, its
metrics rows) must accept the reply or refuse it naming a check, never raise: 2,000 generated
replies, seeded (``derandomize``), within 30 s.

Then one short in-process federation (the real ``run_federation``) in which site C sends a
mutated reply in every round: the honest sites' aggregate is the one without C (by hand: A and B
add 1 and 2 to every shared value, so each round moves gamma_g by (1 + 2) / 2).
"""

from __future__ import annotations

import copy
import math
import random
import time
from typing import Any

import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedst.app import server_app
from fedst.app.inprocess import InProcessGrid
from fedst.app.messaging import SiteGrid, site_of
from fedst.app.reply_logs import log_training_reply, metrics_rows
from fedst.experiment import RoundPolicy
from fedst.federation import transport
from fedst.federation.reply_checks import CHECKS, ReplyChecker, magnitude_bound
from fedst.federation.server import SERVER_CHECKPOINT
from fedst.runs.files import RunLog
from fedst.storage import read_jsonl
from tests.test_federation import tiny_root  # noqa: F401  (the fixture)
from tests.test_reply_checks import federate_with

REFERENCE = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
EXAMPLES = 2000
SECONDS = 30.0

# -- the valid replies and their mutations -----------------------------------------------------

SCALARS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 1e300, 1e30, -1.0, 0, 0.5, 2**62, -(2**40)]),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.floats(allow_nan=False, width=32), max_size=3),
)
"""What a MetricRecord can hold in place of a number."""
CONFIG_VALUES = st.one_of(
    SCALARS, st.text(max_size=8), st.booleans(), st.binary(max_size=4), st.just("two")
)
"""What a ConfigRecord can hold in place of a field (text where a number goes included)."""
KEYS = st.one_of(
    st.sampled_from(
        [
            "num-examples",
            "train-loss",
            "seconds",
            "loader-seconds",
            "cuda-peak-allocated-bytes",
            "uniform-weight",
            "fisher-trace",
            "dice",
            "shaft/dice",
            "shaft/frames",
            "site",
            "round",
            "data-size",
            "data-changed",
        ]
    ),
    st.text(min_size=1, max_size=12),
)
TENSOR_FAULTS = st.sampled_from(
    ["int64", "bool", "shape", "nan", "inf", "huge", "missing", "extra", "legacy", "none"]
)


def valid_content(kind: str, site: str, server_round: int) -> dict[str, Any]:
    """A valid reply of ``site`` as plain dicts: "site", "metrics" and, for training, "tensors"."""
    record = {"site": site, "round": server_round}
    if kind == MessageType.TRAIN:
        return {
            "site": {**record, "data-size": 3},
            "metrics": {"num-examples": 3, "train-loss": 0.5, "seconds": 0.1},
            "tensors": {"w": torch.full((2, 3), 0.5), "b": torch.full((3,), -0.5)},
        }
    metrics = {"num-examples": 4, "dice": 50.0, "iou": 40.0, "hd95": 3.0, "assd": 1.0}
    return {"site": record, "metrics": {**metrics, "shaft/dice": 0.4, "shaft/frames": 3}}


RECORDS = st.sampled_from(["site", "metrics"])
MUTATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("drop"), RECORDS, KEYS),
        st.tuples(st.just("set-metric"), KEYS, SCALARS),
        st.tuples(st.just("set-site"), KEYS, CONFIG_VALUES),
        st.tuples(st.just("rename"), RECORDS, KEYS, KEYS),
        st.tuples(st.just("empty"), st.sampled_from(["site", "metrics", "tensors"])),
        st.tuples(st.just("retype"), RECORDS),
        st.tuples(st.just("tensor"), TENSOR_FAULTS),
        st.tuples(st.just("set-site"), st.just("site"), st.sampled_from(["A", "C", "", "b"])),
        st.tuples(st.just("set-site"), st.just("round"), st.sampled_from([0, 1, 3, 2.5, -2])),
        st.tuples(st.just("twice")),
    ),
    min_size=1,
    max_size=4,
)
"""One to four mutations of a reply, each a tuple (operation, arguments...)."""


def mutated(content: dict[str, Any], ops: list[tuple]) -> tuple[dict[str, Any], bool]:
    """(content after ``ops``, whether the reply is delivered twice)."""
    content = copy.deepcopy(content)
    twice = False
    content["legacy"] = False
    for op, *args in ops:
        record = content.get(args[0]) if args else None
        record = record if isinstance(record, dict) else None  # retyped: left as it is
        if op == "drop" and record is not None:
            record.pop(args[1], None)
        elif op == "set-metric" and isinstance(content.get("metrics"), dict):
            content["metrics"][args[0]] = args[1]
        elif op == "set-site" and isinstance(content.get("site"), dict):
            content["site"][args[0]] = args[1]
        elif op == "rename" and record is not None and args[1] in record:
            record[args[2]] = record.pop(args[1])
        elif op == "empty":
            content[args[0]] = {}
        elif op == "retype" and record is not None:  # a record of the other type, same name
            content[args[0]] = ("other", record)
        elif op == "tensor" and args[0] == "legacy":
            content["legacy"] = True  # one Array per tensor, no manifest (the older layout)
        elif op == "tensor" and "tensors" in content:
            content["tensors"] = _tensor_fault(content["tensors"], args[0])
        elif op == "twice":
            twice = True
    return content, twice


def _tensor_fault(tensors: dict[str, torch.Tensor], fault: str) -> dict[str, torch.Tensor]:
    w = tensors.get("w", torch.zeros(2, 3)).float()
    changed = {
        "int64": w.round().to(torch.int64),
        "bool": w > 0,
        "shape": torch.zeros(7),
        "nan": torch.full_like(w, math.nan),
        "inf": torch.full_like(w, -math.inf),
        "huge": torch.full_like(w, 1e30),
    }
    if fault == "missing":
        return {k: v for k, v in tensors.items() if k != "w"}
    if fault == "extra":
        return {**tensors, "q": torch.zeros(1)}
    return {**tensors, "w": changed[fault]} if fault in changed else tensors


def build(content: dict[str, Any], instruction: Message) -> Message:
    """The reply Message of plain ``content`` (a value a record cannot hold is left out: the site
    could not have sent it)."""
    records: dict = {}
    for name, kind in (("site", ConfigRecord), ("metrics", MetricRecord)):
        if name not in content:
            continue
        value = content[name]
        if isinstance(value, tuple):  # retyped: a record of the other type
            other = MetricRecord if kind is ConfigRecord else ConfigRecord
            kind, value = other, value[1]
        fields = {}
        for key, field_value in value.items():
            try:
                kind({key: field_value})
            except (TypeError, ValueError):  # Flower refuses it at the site already
                continue
            fields[key] = field_value
        records[name] = kind(fields)
    tensors = content.get("tensors")
    if tensors and content.get("legacy"):
        records["arrays"] = ArrayRecord(dict(tensors))
    elif tensors:
        finite = {k: torch.nan_to_num(v, posinf=1.0, neginf=-1.0) for k, v in tensors.items()}
        packed = transport.pack(finite, "fp32")
        if any(v.is_floating_point() and not bool(v.isfinite().all()) for v in tensors.values()):
            # past the site's own guard, as a broken site would be: NaN / inf in the buffer
            flat = packed.buffers["float32"].numpy().copy()
            values = torch.cat(
                [v.flatten().float() for v in tensors.values() if v.is_floating_point()]
            )
            flat[:] = values.numpy()
            packed.buffers["float32"] = Array(flat)
        records.update(packed.records())
    return Message(RecordDict(records), reply_to=instruction)


class MutatingGrid(InProcessGrid):
    """Node 1 (site A) answers validly; node 2 (site B) with the mutated reply of the example
    (``self.ops``), delivered twice when the mutation says so."""

    def __init__(self) -> None:
        super().__init__(self.reply, [{}, {}])
        self.ops: list[tuple] = []
        self.twice = False

    def reply(self, message: Message, context) -> Message:
        site = "AB"[message.metadata.dst_node_id - 1]
        server_round = int(message.content["config"]["server-round"])
        content = valid_content(message.metadata.message_type, site, server_round)
        if site == "B":
            content, self.twice = mutated(content, self.ops)
        return build(content, message)

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        return [*replies, *replies[1:]] if self.twice else replies


def handle(sites: SiteGrid, kind: str, runlog: RunLog) -> set[str]:
    """The server's handling of one step's replies: ``SiteGrid.ask`` and what the ServerApp then
    reads of every accepted reply. Returns what became of B's reply: the checks that refused it,
    or {"accepted"}."""
    train = kind == MessageType.TRAIN
    down = transport.pack(REFERENCE, "fp32")
    replies = sites.ask(
        kind, down, {"server-round": 2}, 2, kind, reference=REFERENCE if train else None
    )
    assert "A" in [site_of(r) for r in replies.replies], replies.refused
    assert all(r.check in CHECKS for r in replies.refused)
    # every left-out reply was refused by a check (a stand-in that failed would hide a case)
    assert all(reason.startswith("reply refused") for reason in replies.failed.values())
    for reply in replies.replies:
        if train:
            up = transport.received(reply.content)
            log_training_reply(runlog, reply, up, {}, 2, 1, replies.norms.get(site_of(reply)))
            server_app._with_arrays(reply, replies.states[site_of(reply)], "w", 0.5)
            assert math.isclose(sum(replies.weights.values()), 1.0)
        else:
            metrics_rows(reply, 2)
    outcome = {r.check for r in replies.refused if r.site == "B"}
    return outcome | ({"accepted"} if "B" in [site_of(r) for r in replies.replies] else set())


@pytest.fixture(scope="module")
def fuzzed_sites(tmp_path_factory):
    grid = MutatingGrid()
    checker = ReplyChecker(max_data_change=2.0, bound=magnitude_bound("fp32"))
    sites = SiteGrid(grid, ["A", "B"], RoundPolicy(min_sites=1), checker=checker)
    sites.connect()
    sites.sites_of.update({1: "A", 2: "B"})  # as after round 1
    runlog = RunLog(tmp_path_factory.mktemp("fuzz"), tensorboard=False)
    return grid, sites, runlog


def test_the_reply_boundary_accepts_or_refuses_2000_mutated_replies_and_never_raises(
    fuzzed_sites,
):
    grid, sites, runlog = fuzzed_sites
    seen = {"count": 0}
    outcomes: dict[str, int] = {}
    started = time.perf_counter()

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(kind=st.sampled_from([MessageType.TRAIN, MessageType.EVALUATE]), ops=MUTATIONS)
    def one_reply(kind, ops):
        grid.ops = ops
        seen["count"] += 1
        for outcome in handle(sites, kind, runlog):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    one_reply()
    seconds = time.perf_counter() - started
    assert seen["count"] >= EXAMPLES
    assert seconds < SECONDS, f"{seen['count']} replies took {seconds:.1f} s"
    # the mutations reach every check of a single reply, and some replies stay acceptable
    single = {"schema", "round", "site", "wire", "keys", "shapes", "dtype", "finite", "magnitude"}
    assert single | {"accepted"} <= set(outcomes), outcomes


# -- a federation with a site that sends mutated replies every round ----------------------------

REFUSED_MUTATIONS = [
    [("set-site", "round", "two")],
    [("tensor", "int64")],
    [("tensor", "huge")],
    [("tensor", "nan")],
    [("tensor", "shape")],
    [("drop", "metrics", "num-examples")],
    [("set-metric", "seconds", [1.0, 2.0])],
    [("set-metric", "num-examples", 1e9)],
    [("set-site", "site", 3)],
    [("empty", "metrics")],
    [("retype", "site")],
]
"""Mutations every one of which must be refused (drawn at random, seeded, per round)."""


def test_a_site_sending_mutated_replies_every_round_leaves_the_honest_aggregate_alone(
    tiny_root,  # noqa: F811
    tmp_path,
):
    draw = random.Random(59)

    def sites_of(shared: list[str]):
        def reply(message: Message, context) -> Message:
            site = "ABC"[message.metadata.dst_node_id - 1]
            server_round = int(message.content["config"]["server-round"])
            content = valid_content(message.metadata.message_type, site, server_round)
            if message.metadata.message_type == MessageType.TRAIN:
                received = transport.unpack(message.content)
                delta = {"A": 1, "B": 2, "C": 4}[site]
                content["tensors"] = {k: received[k] + delta for k in shared}
            if site == "C":
                content, _ = mutated(content, draw.choice(REFUSED_MUTATIONS))
            return build(content, message)

        return reply

    run_dir = tmp_path / "run"
    initial = federate_with(tiny_root, run_dir, sites_of, RoundPolicy(min_sites=2))
    global_model = torch.load(run_dir / SERVER_CHECKPOINT, weights_only=False)["global_model"]
    for key, value in initial.items():  # each of the 2 rounds: (1 + 2) / 2, C never averaged
        torch.testing.assert_close(global_model[key], value + 1.5 * 2, msg=key)
    missing = [row["missing"] for row in read_jsonl(run_dir / "participation.jsonl")]
    assert missing == [["C"], ["C"]]
