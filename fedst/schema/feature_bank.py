"""Where SERQ's feature bank lives in a run directory (fedst/methods/feature_bank.py writes it),
without torch: fedst.runs.layout names the scratch file with every other run file, and a failed
command's clean-up (fedst/cli.py ``has_results``) reads that layout before any torch import."""

from __future__ import annotations

FEATURE_BANK_DIR = "checkpoints/feature_bank"
"""The bank's folder in the run directory (beside ``checkpoints/server.pt``)."""
SERQ_BANK_SCRATCH = "serq_bank.work"
"""The scratch file of a DiskFeatureBank in the run directory (not a checkpoint)."""
