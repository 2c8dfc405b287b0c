"""Shared tensors on the wire: a few contiguous buffers and a manifest (one place for both apps).

A payload ``{key: tensor}`` (gamma, the initial model, or rho in the exchanges) travels as two
records of one message, for a record name such as ``"arrays"``:

* ``"arrays"``: an ArrayRecord with **one 1-D buffer per wire dtype** (keys ``"float32"``,
  ``"float16"``, ``"bfloat16"``, and e.g. ``"int64"`` should an integer tensor travel), the
  tensors' values concatenated in payload order;
* ``"arrays.manifest"``: a ConfigRecord ``{"version": 1, "tensors": <JSON list>}``, one entry
  ``{"key", "shape", "dtype", "offset"}`` per tensor, ``offset`` counting elements of its
  buffer. It is what the receiver unpacks with and what the server's audit (wire.jsonl) and its
  byte accounting (comm.jsonl) read.

Why buffers: Flower 1.41 moves every Array of a message as separate objects (each a request, at
most two in flight, each retried with a back-off when not yet there), so ~235 tensors made every
deployed message wait seconds; a few buffers of at most 5 MiB chunks do not (docs/deployment.md).
Why a ConfigRecord with JSON next to the buffers: the manifest stays one readable, versioned
value the audit can log, and is no Array, so Flower's strategies and DP mods, which treat every
Array of an ArrayRecord as parameters, never average or clip it; ConfigRecord lists cannot hold
the ragged shapes.

Precision (``comm.precision``: fp32 | fp16 | bf16) applies before packing, to floating-point
tensors only; integer and bool tensors travel exactly. A floating-point tensor that is NaN or inf
once cast (a non-finite value, or under fp16 a value beyond 65504) is refused with
:class:`WireValueError` naming it: nothing non-finite is ever sent, by a site or the server.
The receiver restores floats to fp32, so the server aggregates in fp32 and sites load fp32
values. NumPy has no bfloat16, so the bfloat16
buffer travels as its raw 16-bit patterns (an int16 array) and the manifest's dtype names it.

A message in the older layout (one Array per tensor, no manifest), an unknown manifest version,
a malformed manifest, buffers that do not match it, or a payload without a key the receiver
needs are refused with one line (:class:`WireFormatError`) naming the record and the fix. The
older layout is refused rather than read: a site of the older version cannot read this layout
either, so a mixed federation has to be updated, and one reading path keeps the audit's proof (no
personalized key, nothing image-shaped) in one place.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

MANIFEST_VERSION = 1
"""Layout of the manifest this FedST writes and reads."""
MANIFEST_SUFFIX = ".manifest"
"""The manifest of record ``<name>`` is the ConfigRecord ``<name>.manifest``."""

_WIRE_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_FIELDS = ("key", "shape", "dtype", "offset")
_SAME_VERSION = "run the same FedST version at the server and at every site"


class WireFormatError(ValueError):
    """A message's parameters cannot be unpacked: older layout, unknown manifest, missing key."""


class WireValueError(ValueError):
    """A tensor cannot be sent: it holds NaN or inf, or values beyond the wire precision's range
    (fp16: |x| > 65504 would arrive as inf)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _buffer_numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype a buffer of wire dtype ``name`` travels as (bfloat16: int16 patterns)."""
    try:
        return np.dtype("int16") if name == "bfloat16" else np.dtype(name)
    except TypeError:
        raise WireFormatError(
            f"unknown wire dtype {name!r} in a manifest: {_SAME_VERSION}"
        ) from None


@dataclass(frozen=True)
class WireTensor:
    """One manifest entry: tensor ``key`` of ``shape`` is elements [offset, offset + numel) of
    the buffer of wire dtype ``dtype``."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of its values on the wire (numel x element size of the wire dtype)."""
        return self.numel * _buffer_numpy_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Packed:
    """A payload as it travels: the buffers, their manifest and its parsed entries."""

    buffers: ArrayRecord
    manifest: ConfigRecord
    tensors: tuple[WireTensor, ...]

    def records(self, name: str = "arrays") -> dict[str, ArrayRecord | ConfigRecord]:
        """The two records of a message's content: ``name`` and ``name.manifest``."""
        return {name: self.buffers, name + MANIFEST_SUFFIX: self.manifest}

    @property
    def param_bytes(self) -> int:
        """Bytes of the parameter values alone (the paper's Table IX measure)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def wire_bytes(self) -> int:
        """Serialized bytes of both records (Flower's ``count_bytes``: data plus keys)."""
        return self.buffers.count_bytes() + self.manifest.count_bytes()

    def shapes(self) -> dict[str, list[int]]:
        """Key -> shape of every tensor (what the audit logs; never values)."""
        return {t.key: list(t.shape) for t in self.tensors}

    def unpack(self, expected: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """The tensors, floats in fp32, in payload order; refuses a payload without a key of
        ``expected`` (what the receiver needs)."""
        keys = {t.key for t in self.tensors}
        missing = [k for k in expected if k not in keys]
        if missing:
            raise WireFormatError(
                f"the message lacks {len(missing)} tensor(s) this receiver needs, e.g. "
                f"{missing[:3]}: the server and the site disagree on the shared parameters; "
                f"{_SAME_VERSION} and configuration"
            )
        flat = {}
        for name, array in self.buffers.items():
            buffer = torch.from_numpy(array.numpy())  # (N,)
            flat[name] = buffer.view(torch.bfloat16) if name == "bfloat16" else buffer
        state = {}
        for t in self.tensors:
            value = flat[t.dtype][t.offset : t.offset + t.numel].view(t.shape)  # (N,) -> shape
            state[t.key] = value.float() if value.is_floating_point() else value
        return state


def pack(state: Mapping[str, torch.Tensor], precision: str) -> Packed:
    """``state`` as buffers and manifest: floating-point tensors cast to ``precision`` first,
    one contiguous 1-D buffer per wire dtype, entries in ``state``'s order."""
    if precision not in _WIRE_DTYPE:
        raise ValueError(f"comm.precision={precision!r}: expected one of {sorted(_WIRE_DTYPE)}")
    wire_dtype = _WIRE_DTYPE[precision]
    parts: dict[str, list[torch.Tensor]] = {}
    offsets: dict[str, int] = {}
    tensors = []
    for key, value in state.items():
        value = value.detach().to("cpu")
        if value.is_floating_point():
            cast = value.to(wire_dtype)
            if not bool(cast.isfinite().all()):
                raise WireValueError(_unsendable(key, value, precision))
            value = cast
        name = _dtype_name(value.dtype)
        tensors.append(WireTensor(key, tuple(value.shape), name, offsets.get(name, 0)))
        offsets[name] = offsets.get(name, 0) + value.numel()
        parts.setdefault(name, []).append(value.reshape(-1))  # shape -> (numel,)
    buffers = {}
    for name, values in parts.items():
        buffer = torch.cat(values)  # (sum of numel,)
        if name == "bfloat16":
            buffer = buffer.view(torch.int16)
        buffers[name] = Array(buffer.numpy())
    entries = [
        {"key": t.key, "shape": list(t.shape), "dtype": t.dtype, "offset": t.offset}
        for t in tensors
    ]
    manifest = ConfigRecord(
        {"version": MANIFEST_VERSION, "tensors": json.dumps(entries, separators=(",", ":"))}
    )
    return Packed(ArrayRecord(buffers), manifest, tuple(tensors))


def _unsendable(key: str, value: torch.Tensor, precision: str) -> str:
    """Why tensor ``key`` (``value`` before the cast to ``precision``) cannot be sent."""
    if not bool(value.isfinite().all()):
        return f"tensor {key} holds NaN or inf values: a non-finite update is never sent"
    largest = float(value.abs().max())
    limit = torch.finfo(_WIRE_DTYPE[precision]).max
    return (
        f"tensor {key} holds values up to |x| = {largest:.6g}, beyond comm.precision={precision}'s "
        f"largest finite value {limit:.6g} (they would arrive as inf): use comm.precision=bf16 or "
        f"fp32"
    )


def received(content: RecordDict, name: str = "arrays") -> Packed:
    """Record ``name`` of a message with its manifest, checked: the manifest's version and
    fields, and that its entries tile the buffers exactly (nothing travels undescribed)."""
    if name not in content.array_records:
        raise WireFormatError(f"the message has no record {name!r}: {_SAME_VERSION}")
    buffers = content.array_records[name]
    manifest_name = name + MANIFEST_SUFFIX
    if manifest_name not in content.config_records:
        raise WireFormatError(
            f"record {name!r} carries {len(buffers)} arrays but no manifest {manifest_name!r}: "
            f"it was sent in the older layout (one array per tensor); {_SAME_VERSION}"
        )
    manifest = content.config_records[manifest_name]
    tensors = _parse(manifest, manifest_name)
    _check_tiling(tensors, buffers, name)
    return Packed(buffers, manifest, tensors)


def unpack(
    content: RecordDict, name: str = "arrays", expected: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """The tensors of record ``name`` of a message, floats in fp32 (:meth:`Packed.unpack`)."""
    return received(content, name).unpack(expected)


def describe(content: RecordDict) -> dict[str, dict[str, list[int]]]:
    """Record name -> {key: shape} of every packed record of a message, read from its manifest
    (checked like :func:`received`); an ArrayRecord without a manifest is listed by its arrays."""
    return {
        name: received(content, name).shapes()
        if name + MANIFEST_SUFFIX in content.config_records
        else {key: list(array.shape) for key, array in record.items()}
        for name, record in content.array_records.items()
    }


def _parse(manifest: ConfigRecord, manifest_name: str) -> tuple[WireTensor, ...]:
    """The entries of a manifest; one-line errors for an unknown version or a missing key."""
    for field in ("version", "tensors"):
        if field not in manifest:
            raise WireFormatError(f"manifest {manifest_name!r} has no {field!r}: {_SAME_VERSION}")
    version = manifest["version"]
    if version != MANIFEST_VERSION:
        raise WireFormatError(
            f"manifest {manifest_name!r} has version {version!r}, this FedST reads version "
            f"{MANIFEST_VERSION}: {_SAME_VERSION}"
        )
    try:
        entries = json.loads(str(manifest["tensors"]))
    except json.JSONDecodeError as err:
        raise WireFormatError(f"manifest {manifest_name!r}: 'tensors' is not JSON ({err})") from err
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise WireFormatError(f"manifest {manifest_name!r}: 'tensors' is not a list of entries")
    tensors = []
    for index, entry in enumerate(entries):
        absent = [f for f in _FIELDS if f not in entry]
        if absent:
            raise WireFormatError(
                f"manifest {manifest_name!r}: entry {index} has no {absent[0]!r}: {_SAME_VERSION}"
            )
        tensors.append(
            WireTensor(
                str(entry["key"]),
                tuple(int(s) for s in entry["shape"]),
                str(entry["dtype"]),
                int(entry["offset"]),
            )
        )
    keys = [t.key for t in tensors]
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise WireFormatError(f"manifest {manifest_name!r} lists {twice[:3]} more than once")
    return tuple(tensors)


def _check_tiling(tensors: tuple[WireTensor, ...], buffers: ArrayRecord, name: str) -> None:
    """Every buffer is exactly the concatenation of its entries, in order, and of its dtype."""
    by_dtype: dict[str, list[WireTensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    missing = sorted(set(by_dtype) - set(buffers))
    if missing:
        raise WireFormatError(f"record {name!r} has no buffer {missing[0]!r} its manifest names")
    extra = sorted(set(buffers) - set(by_dtype))
    if extra:
        raise WireFormatError(f"record {name!r} has buffers {extra} its manifest does not describe")
    for dtype, entries in by_dtype.items():
        array = buffers[dtype]
        expected_type = _buffer_numpy_dtype(dtype)
        offset = 0
        for t in entries:
            if t.offset != offset:
                raise WireFormatError(
                    f"record {name!r}: {t.key} starts at element {t.offset} of buffer {dtype!r}, "
                    f"expected {offset} (tensors are packed back to back)"
                )
            offset += t.numel
        if np.dtype(array.dtype) != expected_type or tuple(array.shape) != (offset,):
            raise WireFormatError(
                f"record {name!r}: buffer {dtype!r} is {array.dtype} of shape {tuple(array.shape)}"
                f", its manifest describes {expected_type} of shape ({offset},)"
            )
