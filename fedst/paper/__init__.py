"""One command per table of the paper: train the runs a table needs, then write the table.

    python -m fedst.paper table2 [--dry-run] [seeds=0,1,2] [experiment=demo]
    python -m fedst.paper table4 [--runs runs] [--out results] [rows=table4_row2_ts]

The table (first argument) is one of :data:`TABLES`: ``table2`` (sites A-D: Dice / IoU / HD95 / ASSD per site and
Avg.), ``table3`` (site E, out of federation), ``table8`` (GraSP, binary), ``table9``
(communication per site and round in MB and MiB, training time, inference FPS), ``table4`` ..
``table7`` (the ablation rows of configs/ablation/), ``fig6`` (communication interval), ``fig5``
(learning curves of three ways to use the synthetic set: server fine-tuning, synthetic data at
the sites, SERQ) and ``fig7`` (every method without and with the synthetic set mixed into every
site's training data, iterations doubled; the "without" runs are Table II's).

Each table declares its rows (a method of configs/method/ or an ablation of configs/ablation/, in
the paper's order); every row runs once per seed. A run is table-independent: its directory is
``<runs>/<experiment name>/<row name>_s<seed>/`` (Tables II, III, VIII and IX and Fig. 7's
"without" bars share the same eight methods' runs). A row may be an ablation applied to another
method than FedST (Fig. 7: ``method=fedavg +ablation=fig7_synthetic``) and may scale
``train.total_iters`` by a factor of the experiment's (Fig. 7 and Fig. 5's green line: x2; the
rounds, total_iters // local_iters, double with it). For each run the runner

* skips it when it is finished: ``final.json`` written by the end of its training
  (fedst/runs/files.py ``unfinished``) and the run's ``config.json`` equal to the
  config the command composes (up to ``train.eval_every / device / num_workers``, which do not
  change what a run learns: fedst/schema/roles.py);
* resumes it when it was interrupted (``checkpoints/server.pt`` present: the resume machinery of
  ``fedst.training.run_training``, as ``train_fed.py resume=...``);
* trains it otherwise, through the same entry as train_fed.py (``run_training``), logging
  ``run i/N`` and the elapsed time;
* refuses to start when a run directory holds a run of another config (the differing keys are
  named; use another ``--runs`` folder or delete that directory).

A row whose config file does not exist (a method not implemented yet) or does not compose stays
in the table as "n/a" with 0 runs and a note saying why; it is never dropped. A run that fails is
logged, the others still run, its row shows the runs that finished, and the command exits with 1.
The tables (markdown and CSV) go to ``<out>/<experiment name>/<TABLE>.md|csv`` (``<out>``:
``results``, or ``<runs>/results`` when ``--runs`` is not the default): mean ± sample std
over seeds (fedst/report/results.py, fedst/report/tables.py); Figs. 5, 6 and 7 also write ``<TABLE>.png`` there. ``--dry-run``
lists every run, its state and the overrides the row adds, and trains nothing.

Seeds and rows are the runner's own keys (``seeds=0,1,2``, ``rows=local,fedavg``); every other
argument is a Hydra override applied to every run (``experiment=demo``, ``train.device=cpu``);
``seed=``, ``method=``, ``+ablation=``, ``resume=`` and ``site=`` are the runner's to set and are
refused.

The package reads top to bottom: ``tables.py`` (what each table needs: rows and layout),
``planning.py`` (the runs, their states, training them), ``writing.py`` (Table IX's timing and
speed, the tables and figures), ``cli.py`` (the command).

Layer: an entry point; imports fedst.training, fedst.report, fedst.infer and below.
"""

from fedst.paper.cli import DEFAULT_RUNS, main, tables_root
from fedst.paper.planning import (
    LABEL_KEYS,
    Plan,
    PlannedRun,
    compose_row,
    describe,
    execute,
    parse_arguments,
    plan_table,
)
from fedst.paper.tables import TABLES, Row, RunnerError, TableSpec, synthetic_in_training
from fedst.paper.writing import FpsSettings, build_tables, measure_fps, write_outputs

__all__ = [
    "DEFAULT_RUNS",
    "LABEL_KEYS",
    "TABLES",
    "FpsSettings",
    "Plan",
    "PlannedRun",
    "Row",
    "RunnerError",
    "TableSpec",
    "build_tables",
    "compose_row",
    "describe",
    "execute",
    "main",
    "measure_fps",
    "parse_arguments",
    "plan_table",
    "synthetic_in_training",
    "tables_root",
    "write_outputs",
]
