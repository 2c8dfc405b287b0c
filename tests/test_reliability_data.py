"""Data reliability: user data is never deleted, every frame a clip uses is decoded before
training, every configured site is validated up front, and bad files are named."""

from __future__ import annotations

import pytest

from fedst.data.base import DataError
from fedst.data.check import main as check_main
from fedst.data.generic import GenericLayoutSource


def test_a_split_file_with_non_utf8_bytes_is_an_error_naming_the_file(write_site):
    site = write_site("D", videos={"v1": 3})
    split = site.site_dir / "splits" / "train.txt"
    split.write_bytes(b"v1\n\xff\xfe\n")
    with pytest.raises(DataError) as caught:
        GenericLayoutSource(site.root, "D").videos("train")
    assert str(split) in str(caught.value) and "UTF-8" in str(caught.value)


def test_a_malformed_data_yaml_exits_two_with_the_file_named(tmp_path, capsys):
    config = tmp_path / "broken.yaml"
    config.write_text("federation: [A, B\nsites:\n  A: {backend: generic\n")
    assert check_main([f"data={config}"]) == 2
    assert str(config) in capsys.readouterr().err
