"""Shared tensors on the wire as a few buffers and a manifest (issue 23, fedst/federation/transport.py):
exact for every dtype and precision through Flower's own serialization, and refused with one line
when the layout is older, the manifest unknown or malformed, or a needed key is missing."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

from fedst.app import reply_logs
from fedst.federation import transport

WIRE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def payload() -> dict[str, torch.Tensor]:
    """Every shape that can travel: a matrix, a 0-d scalar, a 1-element and two empty tensors,
    and integer buffers (a 0-d num_batches_tracked and a vector) that must travel exactly."""
    generator = torch.Generator().manual_seed(0)
    return {
        "encoder.w": torch.randn(5, 7, generator=generator) * 100,
        "encoder.scalar": torch.tensor(-3.3),
        "decoder.one": torch.tensor([1e-3]),
        "decoder.empty": torch.zeros(0, 3),
        "decoder.head.empty": torch.zeros(0),
        "bn.num_batches_tracked": torch.tensor(2**40 + 3, dtype=torch.int64),
        "counter": torch.tensor([-1, 0, 2**62], dtype=torch.int64),
    }


def over_the_wire(content: RecordDict) -> RecordDict:
    """``content`` serialized into Flower's objects and rebuilt from their bytes, as a message
    is between the SuperLink, the SuperNode and the ClientApp."""
    objects = get_all_nested_objects(content)
    contents = {object_id: obj.deflate() for object_id, obj in objects.items()}
    return inflate_object_from_contents(content.object_id, contents)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_packing_is_exact_for_every_dtype_and_precision(precision):
    """Floats arrive as exactly the wire precision's value in fp32, integers bit for bit, keys in
    order and shapes (0-d, 1-element, empty) unchanged; one buffer per wire dtype."""
    state = payload()
    packed = transport.pack(state, precision)
    wire_float = str(WIRE[precision]).removeprefix("torch.")
    assert sorted(packed.buffers) == sorted([wire_float, "int64"])
    back = transport.unpack(over_the_wire(RecordDict(packed.records())))
    assert list(back) == list(state)
    for key, value in state.items():
        if value.is_floating_point():
            assert back[key].dtype == torch.float32, key
            assert torch.equal(back[key], value.to(WIRE[precision]).float()), key
        else:
            assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
        assert back[key].shape == value.shape, key
    size = {"fp32": 4, "fp16": 2, "bf16": 2}[precision]
    floats = sum(v.numel() for v in state.values() if v.is_floating_point())
    assert packed.param_bytes == size * floats + 8 * 4
    assert packed.param_bytes == sum(a.numpy().nbytes for a in packed.buffers.values())


def test_bf16_travels_as_bit_patterns_distinct_from_a_real_int16_tensor():
    """NumPy has no bfloat16: its buffer is int16 patterns, and the manifest (not the array's
    dtype) says so, so a genuine int16 tensor in the same message stays an integer."""
    state = {
        "w": torch.tensor([1.5, -2.0, 3.0e38]),
        "i": torch.tensor([-7, 300], dtype=torch.int16),
    }
    back = transport.unpack(RecordDict(transport.pack(state, "bf16").records()))
    assert torch.equal(back["w"], state["w"].to(torch.bfloat16).float())
    assert back["i"].dtype == torch.int16 and torch.equal(back["i"], state["i"])


def test_an_empty_payload_is_a_manifest_without_buffers():
    packed = transport.pack({}, "fp16")
    assert len(packed.buffers) == 0 and packed.param_bytes == 0
    assert transport.unpack(RecordDict(packed.records())) == {}


def test_the_manifest_gives_the_audit_and_the_accounting_every_key_and_shape():
    state = payload()
    content = RecordDict(transport.pack(state, "fp16").records("personal"))
    assert transport.describe(content) == {"personal": {k: list(v.shape) for k, v in state.items()}}
    by_component = reply_logs.bytes_by_component(transport.received(content, "personal"))
    assert by_component == {
        "encoder": 2 * (35 + 1),
        "decoder": 2 * 1,  # decoder.one; decoder.empty has no value
        "head": 0,  # decoder.head.empty: listed, with no value
        "other": 8 * 4,  # the integer buffers: int64, whatever the float precision
    }


# -- refusals: one line naming the record and the fix -------------------------------------------


def packed_content(**manifest_changes) -> RecordDict:
    packed = transport.pack({"a": torch.ones(2, 3), "b": torch.zeros(4)}, "fp32")
    manifest = dict(packed.manifest)
    manifest.update(manifest_changes)
    return RecordDict({"arrays": packed.buffers, "arrays.manifest": ConfigRecord(manifest)})


def refusal(content: RecordDict, expected=()) -> str:
    with pytest.raises(transport.WireFormatError) as caught:
        transport.unpack(content, "arrays", expected)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_message_in_the_older_per_tensor_layout_is_refused():
    old = RecordDict({"arrays": ArrayRecord({"a": torch.ones(2, 3), "b": torch.zeros(4)})})
    message = refusal(old)
    assert "no manifest 'arrays.manifest'" in message and "older layout" in message
    assert "same FedST version" in message


def test_an_unknown_manifest_version_is_refused():
    message = refusal(packed_content(version=2))
    assert "version 2" in message and "reads version 1" in message


@pytest.mark.parametrize("field", ["version", "tensors"])
def test_a_manifest_without_one_of_its_keys_is_refused(field):
    content = packed_content()
    manifest = dict(content["arrays.manifest"])
    del manifest[field]
    content["arrays.manifest"] = ConfigRecord(manifest)
    assert f"has no {field!r}" in refusal(content)


@pytest.mark.parametrize("field", ["key", "shape", "dtype", "offset"])
def test_a_manifest_entry_without_one_of_its_keys_is_refused(field):
    entries = json.loads(str(packed_content()["arrays.manifest"]["tensors"]))
    del entries[1][field]
    message = refusal(packed_content(tensors=json.dumps(entries)))
    assert f"entry 1 has no {field!r}" in message


def test_a_payload_without_a_key_the_receiver_needs_is_refused():
    message = refusal(packed_content(), expected=["a", "b", "c.weight"])
    assert "lacks 1 tensor(s)" in message and "c.weight" in message


def test_buffers_the_manifest_does_not_describe_exactly_are_refused():
    """The audit logs the manifest, so nothing may travel outside it: a hidden extra buffer, a
    buffer longer than its entries, or an entry claiming another shape are refused."""
    hidden = packed_content()
    hidden["arrays"]["float16"] = ArrayRecord({"x": torch.zeros(512 * 640).half()})["x"]
    assert "buffers ['float16'] its manifest does not describe" in refusal(hidden)
    entries = json.loads(str(packed_content()["arrays.manifest"]["tensors"]))
    entries[1]["shape"] = [2]  # the buffer holds 6 + 4 values
    assert "of shape (10,)" in refusal(packed_content(tensors=json.dumps(entries)))
    entries = json.loads(str(packed_content()["arrays.manifest"]["tensors"]))
    entries[1]["offset"] = 0  # overlapping "a"
    assert "starts at element 0" in refusal(packed_content(tensors=json.dumps(entries)))
    entries = json.loads(str(packed_content()["arrays.manifest"]["tensors"]))
    entries[1]["dtype"] = "float64"
    assert "no buffer 'float64'" in refusal(packed_content(tensors=json.dumps(entries)))
