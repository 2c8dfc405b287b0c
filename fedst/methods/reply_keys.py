"""The scalars of a site's train reply that a method writes or weighs by (its ``reply_metrics``,
its aggregation weights): the one place their wire names are spelled. Below the methods, the
federation and the apps, which all read them; fedst/app/keys.py lists them with the rest of the
message vocabulary."""

NUM_EXAMPLES = "num-examples"
"""The site's training-sample count n_k (FedAvg's weight under ``aggregation_weights=samples``)."""
UNIFORM_WEIGHT = "uniform-weight"
"""A site's weight under uniform aggregation: always 1 (FedST's 1/K of Algorithm 1, line 8)."""
TRAIN_LOSS = "train-loss"
"""The mean training loss of the site's round."""
ITERATIONS = "iterations"
"""The local iterations the site ran in its round."""
