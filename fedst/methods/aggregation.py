"""Which Flower strategy aggregates gamma_k (Algorithm 1, line 8), from the method's config.

* fedavg + uniform: gamma_g = 1/K sum_k gamma_k (the paper's Algorithm 1, line 8; FedST's default).
* fedavg + samples: gamma_g = sum_k n_k / n gamma_k (McMahan et al.; the FedAvg baseline).
* fedavg + fisher: gamma_g = sum_k F_k / sum_j F_j gamma_k with F_k the trace of site k's
  empirical Fisher information (FedAS, Yang et al. CVPR 2024; only FedAS replies carry it).
* fedmedian: the coordinate-wise median (unweighted).

Flower's FedAvg weights each reply by one key of its MetricRecord (``weighted_by_key``): every
site reply carries "num-examples" (n_k) and :data:`UNIFORM_WEIGHT_KEY` = 1, so both weightings are
Flower's own arithmetic.
"""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg, FedMedian, Strategy

UNIFORM_WEIGHT_KEY = "uniform-weight"
"""MetricRecord key of a site's weight under uniform aggregation (always 1)."""
SAMPLES_WEIGHT_KEY = "num-examples"
"""MetricRecord key of a site's training-sample count n_k."""
FISHER_WEIGHT_KEY = "fisher-trace"
"""MetricRecord key of a FedAS site's empirical-Fisher trace (fedst/methods/fedas.py)."""
WEIGHT_KEYS = {
    "uniform": UNIFORM_WEIGHT_KEY,
    "samples": SAMPLES_WEIGHT_KEY,
    "fisher": FISHER_WEIGHT_KEY,
}


def make_strategy(aggregation: str, aggregation_weights: str) -> Strategy:
    """The Flower strategy of ``method.aggregation`` / ``method.aggregation_weights``."""
    if aggregation == "fedmedian":
        return FedMedian(weighted_by_key=WEIGHT_KEYS[aggregation_weights])
    if aggregation == "fedavg":
        return FedAvg(weighted_by_key=WEIGHT_KEYS[aggregation_weights])
    raise ValueError(f"unknown aggregation {aggregation!r}; choose fedavg or fedmedian")
