"""Scoring, shared by the training wing and the post-run wing: the metrics (Dice, IoU, HD95,
ASSD; MONAI; Dice / IoU from pixel counts in overlap.py), the per-frame evaluation of a model on a site's split, and a site's data as
training and evaluation read it.

Layer: above fedst.methods; imports fedst.methods (for types), fedst.experiment, fedst.model,
fedst.data and the root, never fedst.runs, fedst.federation or what stands on them.
"""
