"""Each key of the wire is spelled once: in fedst/app/keys.py, or, for the scalars a method writes
or weighs by, in fedst/methods/reply_keys.py (below every module that reads them). Every other
module names the constant, so the two sides of the wire cannot drift apart."""

from __future__ import annotations

from pathlib import Path

from conftest import strings_in_code

from fedst.app import keys
from fedst.methods import reply_keys

REPO = Path(__file__).resolve().parents[1]
DEFINING = {REPO / "fedst/app/keys.py", REPO / "fedst/methods/reply_keys.py"}


def wire_keys() -> set[str]:
    """The hyphenated keys (no ordinary word or JSON field is spelled like them)."""
    values = {
        value
        for module in (keys, reply_keys)
        for name, value in vars(module).items()
        if name.isupper() and isinstance(value, str)
    }
    return {value for value in values if "-" in value}


def spelled_outside_their_module(key_names: set[str]) -> list[str]:
    return [
        f"{path.relative_to(REPO).parent}/{found}"
        for path in sorted((REPO / "fedst").rglob("*.py"))
        if path not in DEFINING
        for found in strings_in_code(path, key_names)
    ]


def test_the_wire_keys_include_the_replys_scalars():
    assert {"num-examples", "train-loss", "uniform-weight", "server-round"} <= wire_keys()


def test_no_module_spells_a_wire_key_that_keys_or_reply_keys_defines():
    found = spelled_outside_their_module(wire_keys())
    assert not found, "wire keys spelled outside their module:\n" + "\n".join(found)
