"""Communication sizes in both units the project reports: MB (10^6 bytes) and MiB (2^20 bytes).

The paper's Table IX "Cost (MB)" figures appear to be MiB: its FedRep 13.01 is the PVTv2-b0
encoder (3,409,760 fp32 parameters = 13,639,040 bytes) in MiB (13.007), while in 10^6-byte MB it
is 13.64. Every upload / download figure is therefore given in both, each labelled.
"""

from __future__ import annotations

BYTES_PER_MB = 10**6
"""One megabyte (SI): 10^6 bytes."""
BYTES_PER_MIB = 2**20
"""One mebibyte (IEC): 2^20 = 1,048,576 bytes."""


def megabytes(num_bytes: float) -> float:
    """``num_bytes`` in MB (10^6 bytes)."""
    return num_bytes / BYTES_PER_MB


def mebibytes(num_bytes: float) -> float:
    """``num_bytes`` in MiB (2^20 bytes)."""
    return num_bytes / BYTES_PER_MIB


def mb_to_mib(mb: float) -> float:
    """A size given in MB (10^6 bytes) expressed in MiB (2^20 bytes)."""
    return mebibytes(mb * BYTES_PER_MB)


def format_size(num_bytes: float, digits: int = 2) -> str:
    """``"13.64 MB (13.01 MiB)"``: both units, labelled."""
    return f"{megabytes(num_bytes):.{digits}f} MB ({mebibytes(num_bytes):.{digits}f} MiB)"
