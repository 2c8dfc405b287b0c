"""The federation's engine-agnostic pieces: a site (local training, evaluation, its state), the
server (v_g, the method's server step, checkpoints), the wire format, evaluation, snapshots.

Layer: above fedst.runs; imports fedst.runs, fedst.methods and below, never the apps.
"""
