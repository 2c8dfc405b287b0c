"""The Flower apps: the ServerApp (the rounds, fedst/app/server_app.py) and the ClientApp (a site),
with the in-process grid and Ray's placement; the same apps run in every engine.

Layer: above fedst.report; imports fedst.federation, fedst.runs.outfed and below, never fedst.training
or fedst.deploy.
"""
