"""Specification of DiskFeatureBank (fedst/methods/feature_bank.py): SERQ's working bank in a
scratch file behaves as the dict it replaces, entry for entry, and keeps the entries out of the
process's resident memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedst.methods.feature_bank import DiskFeatureBank

MB = 2**20


def test_entries_read_back_bit_for_bit_and_an_update_keeps_its_slot(tmp_path: Path):
    bank = DiskFeatureBank(tmp_path / "bank.work")
    entries = {f"img_{i}": torch.randn(3, 4, 5).half() for i in range(3)}
    for sample_id, entry in entries.items():
        bank[sample_id] = entry
    assert len(bank) == 3 and list(bank) == ["img_0", "img_1", "img_2"]
    assert "img_1" in bank and "img_9" not in bank and bank.get("img_9") is None
    for sample_id, entry in entries.items():
        got = bank[sample_id]
        assert got.dtype == torch.float16 and torch.equal(got, entry)
    updated = torch.randn(3, 4, 5).half()
    bank["img_1"] = updated
    assert torch.equal(bank["img_1"], updated) and torch.equal(bank["img_2"], entries["img_2"])
    # 3 slots of 3 x 4 x 5 float16 values: the update overwrote its slot
    assert (tmp_path / "bank.work").stat().st_size == 3 * 60 * 2


def test_an_entry_of_another_shape_or_dtype_is_refused(tmp_path: Path):
    bank = DiskFeatureBank(tmp_path / "bank.work")
    bank["a"] = torch.zeros(2, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"'b' is \(3, 2\).*holds \(2, 3\)"):
        bank["b"] = torch.zeros(3, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="float32"):
        bank["b"] = torch.zeros(2, 3)


def test_clear_empties_the_bank_and_close_deletes_the_scratch_file(tmp_path: Path):
    path = tmp_path / "bank.work"
    bank = DiskFeatureBank(path)
    bank["a"] = torch.ones(4, dtype=torch.float16)
    bank.clear()
    assert len(bank) == 0 and path.stat().st_size == 0
    bank["b"] = torch.ones(8, dtype=torch.float16)  # a cleared bank takes a new shape
    assert torch.equal(bank["b"], torch.ones(8, dtype=torch.float16))
    bank.close()
    assert not path.exists()
    with pytest.raises(ValueError, match="closed"):
        bank["b"]


# In a fresh interpreter: 200 entries of 1 MiB (float16 [8, 256, 256]) written to a bank and each
# read back once (as SERQ's EQ step does), in a dict and in a DiskFeatureBank.
FILL_THE_BANK = textwrap.dedent(
    """
    import json, sys, torch
    from pathlib import Path
    from fedst.accel import memory_usage
    from fedst.methods.feature_bank import DiskFeatureBank
    bank = {} if sys.argv[1] == "memory" else DiskFeatureBank(Path(sys.argv[2]))
    before = memory_usage()["rss_bytes"]
    for i in range(200):
        bank[str(i)] = torch.full((8, 256, 256), float(i), dtype=torch.float16)
    total = sum(bank[str(i)][0, 0, 0].item() for i in range(200))
    print(json.dumps({"grown": memory_usage()["rss_bytes"] - before, "total": total}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident size from /proc")
@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_a_disk_bank_of_200_mib_leaves_the_resident_set_as_it_was(storage: str, tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-c", FILL_THE_BANK, storage, str(tmp_path / "bank.work")],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["total"] == sum(range(200))  # every entry read back
    if storage == "memory":
        assert figures["grown"] >= 190 * MB  # the dict holds the 200 MiB (the test's control)
    else:
        assert figures["grown"] <= 20 * MB
