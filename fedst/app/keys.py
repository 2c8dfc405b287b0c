"""The message vocabulary the ServerApp and the ClientApp share: record names, the keys inside
them and the message kinds beyond Flower's train / evaluate. One module, so the two sides of the
wire cannot drift apart (the parameters inside "arrays" / "personal": fedst/federation/transport.py).
"""

from __future__ import annotations

from fedst.methods.reply_keys import ITERATIONS as ITERATIONS
from fedst.methods.reply_keys import NUM_EXAMPLES as NUM_EXAMPLES
from fedst.methods.reply_keys import TRAIN_LOSS as TRAIN_LOSS
from fedst.methods.reply_keys import UNIFORM_WEIGHT as UNIFORM_WEIGHT

# -- records of a message ----------------------------------------------------------------------
ARRAYS = "arrays"
"""gamma: down, gamma_g (round 1: the whole v_g^0); up, the site's gamma_k."""
PERSONAL = "personal"
"""rho_k (the end-of-run export, the final stage's exchange) or the other sites' rho_j."""
CONFIG = "config"
METRICS = "metrics"
SITE = "site"
"""A reply's ConfigRecord naming its site and the round it answers: {SITE_NAME: name, SITE_ROUND:
round[, SHARED: 0 | 1][, DATA_SIZE: n, DATA_CHANGED: 0 | 1]}."""

# -- inside the "site" record ------------------------------------------------------------------
SITE_NAME = "site"
SITE_ROUND = "round"
"""The SERVER_ROUND of the instruction the reply answers (the server refuses another)."""
SHARED = "shared"
"""1 when the site sent its rho_k, 0 when its node config keeps it."""
DATA_SIZE = "data-size"
"""Of a train reply: the size of the site's validated training data (bounds its num-examples)."""
DATA_CHANGED = "data-changed"
"""Of a train reply: 1 when the site's training data changed since its previous saved round."""

# -- inside "config" ---------------------------------------------------------------------------
EXPERIMENT = "experiment"
"""The site view of the experiment (fedst.experiment.site_view), JSON."""
RUN_NAME = "run-name"
LOCAL_ITERS = "local-iters"
SERVER_ROUND = "server-round"
KEEP_ROUNDS = "keep-rounds"
"""Rounds whose state a site keeps (the server's checkpoint rounds: a resumed run restarts there)."""
SPLIT = "split"
"""Of an evaluation: "test" (absent) or "val" (model selection)."""
STATS_SAMPLE_FRAMES = "stats-sample-frames"
"""Of the statistics query: labelled frames each site reads per split (fedst/data/stats.py)."""

# -- inside "metrics" --------------------------------------------------------------------------
# (and the scalars a method writes or weighs by, spelled below the methods: imported above)
SECONDS = "seconds"
LOADER_SECONDS = "loader-seconds"
ENSEMBLE_SIZE = "ensemble-size"
PROCESS_ID = "process-id"
"""Of a train reply: the operating-system process the site ran in (under Ray: its actor)."""
SITE_BUILT = "site-built"
"""Of a train reply: 1 when the site was built (model, optimizer, data) in this process since the
previous train reply (for this message or an evaluate message before it)."""
STATE_RESTORES = "state-restores"
"""Of a train reply: states the site loaded from disk since the previous train reply (0: it
stayed in memory)."""

# -- message kinds beyond Flower's "train" and "evaluate" ------------------------------------------
PERSONAL_QUERY = "personal"
"""The ClientApp's query action (``@app.query``): send rho_k for the out-of-federation average."""
PERSONAL_EXCHANGE_QUERY = "personal_exchange"
"""The query action of a final stage that exchanges rho_k between sites."""
FINAL_STAGE_TRAIN = "final_stage"
"""The train action of a method's final stage."""
STATS_QUERY = "site_stats"
"""The query action of the statistics message at the start of a run (fedst/app/site_statistics.py)."""
QUERY_PERSONAL = f"query.{PERSONAL_QUERY}"
QUERY_SITE_STATS = f"query.{STATS_QUERY}"
QUERY_PERSONAL_EXCHANGE = f"query.{PERSONAL_EXCHANGE_QUERY}"
TRAIN_FINAL_STAGE = f"train.{FINAL_STAGE_TRAIN}"
