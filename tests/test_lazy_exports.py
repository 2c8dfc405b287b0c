"""A package built on fedst.lazy.lazy_exports (fedst.runs, fedst.deploy) imports a module only when
one of its names, or the module itself, is first read, and knows no other name."""

from __future__ import annotations

import sys

import pytest

PACKAGE = """
from fedst.lazy import lazy_exports

EXPORTED_FROM = {"answer": "lazypkg.heavy"}
__getattr__ = lazy_exports(__name__, EXPORTED_FROM, globals())
"""


@pytest.fixture
def lazypkg(tmp_path, monkeypatch):
    root = tmp_path / "lazypkg"
    root.mkdir()
    (root / "__init__.py").write_text(PACKAGE)
    (root / "heavy.py").write_text("answer = 42\n")
    (root / "other.py").write_text("value = 'other'\n")
    (root / "broken.py").write_text("import a_module_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield __import__("lazypkg")
    for name in [n for n in sys.modules if n == "lazypkg" or n.startswith("lazypkg.")]:
        del sys.modules[name]


def test_an_exported_name_imports_its_module_on_first_use_and_is_kept(lazypkg):
    assert "lazypkg.heavy" not in sys.modules
    assert lazypkg.answer == 42
    assert "lazypkg.heavy" in sys.modules
    assert vars(lazypkg)["answer"] == 42  # read once: later reads skip __getattr__


def test_a_submodule_is_an_attribute_as_in_an_eager_package(lazypkg):
    assert "lazypkg.other" not in sys.modules
    assert lazypkg.other.value == "other"


def test_an_unknown_name_is_an_attribute_error_and_a_broken_submodule_says_why(lazypkg):
    with pytest.raises(AttributeError, match="module 'lazypkg' has no attribute 'nope'"):
        lazypkg.nope  # noqa: B018
    with pytest.raises(ModuleNotFoundError, match="a_module_that_is_not_installed"):
        lazypkg.broken  # noqa: B018
