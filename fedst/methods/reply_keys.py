"""The scalars of a site's train reply that a method writes or weighs by (its ``reply_metrics``,
its aggregation weights): the one place their wire names are spelled. Below the methods, the
federation and the apps, which all read them; fedst/app/keys.py lists them with the rest of the
message vocabulary."""

NUM_EXAMPLES = "num-examples"
"""The site's training-sample count n_k (FedAvg's weight under ``aggregation_weights=samples``)."""
UNIFORM_WEIGHT = "uniform-weight"
"""The key of a reply's weight under uniform aggregation (FedST's 1/K of Algorithm 1, line 8),
written by the server into the view its strategy averages; sites before issue 59 sent 1 under it
(now dropped as unknown: no weight a site sends is read)."""
TRAIN_LOSS = "train-loss"
"""The mean training loss of the site's round."""
ITERATIONS = "iterations"
"""The local iterations the site ran in its round."""
