"""The federation's engine-agnostic pieces: a site (local training, evaluation, its state), the
server (v_g, the method's server step, checkpoints), the wire format, the reply checks,
snapshots. Scoring itself (metrics, per-frame evaluation, a site's data) is fedst.scoring.

Layer: above fedst.runs; imports fedst.runs, fedst.methods and below, never the apps.
"""
