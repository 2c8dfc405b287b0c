"""Which Flower strategy aggregates gamma_k (Algorithm 1, line 8), from the method's config.

* fedavg + uniform: gamma_g = 1/K sum_k gamma_k (the paper's Algorithm 1, line 8; FedST's default).
* fedavg + samples: gamma_g = sum_k n_k / n gamma_k (McMahan et al.; the FedAvg baseline).
* fedavg + fisher: gamma_g = sum_k F_k / sum_j F_j gamma_k with F_k the trace of site k's
  empirical Fisher information (FedAS, Yang et al. CVPR 2024; only FedAS replies carry it).
* fedmedian: the coordinate-wise median (unweighted).
* trimmed_mean: Flower's FedTrimmedAvg (Yin et al. 2018), per coordinate the mean of the values
  left after cutting floor(beta x K) of the K sites' values at each end (beta:
  ``fed.trim_fraction``; unweighted). Use it when a minority of sites may send updates that are
  valid (finite, the right shapes, within the norm rule) but pull the mean away: it keeps more of
  the data than the median (K = 4, beta = 0.25: the mean of the middle two values, which is
  FedMedian's value for K = 4; K = 8: of the middle six).

Every reply reaching these strategies passed the server's checks (fedst/federation/reply_checks.py).

Flower's FedAvg weights each reply by one key of its MetricRecord (``weighted_by_key``): the
server computes every weight itself (fedst/federation/reply_checks.server_weights: 1/K, validated
n_k, or a scalar the method declares, bounded) and hands the strategy a view of each reply whose
MetricRecord holds only that weight under :data:`WEIGHT_KEYS` of the weighting
(fedst/app/server_app.py); no weight a site sends is read.
"""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, Strategy

from fedst.methods.reply_keys import NUM_EXAMPLES, UNIFORM_WEIGHT

UNIFORM_WEIGHT_KEY = UNIFORM_WEIGHT
"""MetricRecord key of a reply's uniform weight (1/K), written by the server."""
SAMPLES_WEIGHT_KEY = NUM_EXAMPLES
"""MetricRecord key of a site's training-sample count n_k."""
FISHER_WEIGHT_KEY = "fisher-trace"
"""MetricRecord key of a FedAS site's empirical-Fisher trace (fedst/methods/fedas.py)."""
WEIGHT_KEYS = {
    "uniform": UNIFORM_WEIGHT_KEY,
    "samples": SAMPLES_WEIGHT_KEY,
    "fisher": FISHER_WEIGHT_KEY,
}


def make_strategy(aggregation: str, aggregation_weights: str, trim_fraction: float) -> Strategy:
    """The Flower strategy of ``method.aggregation`` / ``method.aggregation_weights``
    (``trim_fraction``: ``fed.trim_fraction`` of trimmed_mean)."""
    weighted_by_key = WEIGHT_KEYS[aggregation_weights]
    if aggregation == "fedmedian":
        return FedMedian(weighted_by_key=weighted_by_key)
    if aggregation == "fedavg":
        return FedAvg(weighted_by_key=weighted_by_key)
    if aggregation == "trimmed_mean":
        return FedTrimmedAvg(weighted_by_key=weighted_by_key, beta=trim_fraction)
    raise ValueError(
        f"unknown aggregation {aggregation!r}; choose fedavg, fedmedian or trimmed_mean"
    )
