"""Network backbones used by FedST; ``models.pvt`` holds the PVTv2 encoder."""
