"""Specification of fedst.units: communication sizes in MB (10^6 bytes) and MiB (2^20 bytes)."""

from __future__ import annotations

from fedst.units import format_size, mb_to_mib, mebibytes, megabytes

PVT_V2_B0_ENCODER_BYTES = 3_409_760 * 4
"""The PVTv2-b0 encoder's fp32 parameters (3,409,760 x 4 B): the paper's FedRep upload."""


def test_the_pvt_b0_encoder_is_13_64_megabytes_and_13_01_mebibytes():
    # by hand: 13,639,040 / 1,000,000 = 13.63904; 13,639,040 / 1,048,576 = 13.0072...
    assert megabytes(PVT_V2_B0_ENCODER_BYTES) == 13.63904
    assert abs(mebibytes(PVT_V2_B0_ENCODER_BYTES) - 13.007202148) < 1e-9
    assert format_size(PVT_V2_B0_ENCODER_BYTES) == "13.64 MB (13.01 MiB)"


def test_one_mebibyte_is_1_048576_megabytes():
    assert megabytes(2**20) == 1.048576
    assert mebibytes(2**20) == 1.0
    assert mb_to_mib(1.048576) == 1.0
