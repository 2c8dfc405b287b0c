"""FedST: personalized federated segmentation of surgical instruments in video.

Layer: the root; its modules (config, errors, units, seeding, accel, progress) import nothing of
fedst but one another.
"""
