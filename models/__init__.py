"""Network backbones used by FedST; ``models.pvt`` holds the PVTv2 encoder.

Layer: below fedst; imports torch and timm only.
"""
