"""Specification of what `fedst.export` shows (issue 36): its result, not the exporter's passes.

The torch.onnx exporter's graph passes (onnx_ir, onnxscript) log ~270 INFO lines per export and
torch.onnx prints its progress; the export keeps them to warnings. The trained run directory is
tests/test_infer.py's.
"""

from __future__ import annotations

import logging

from test_infer import run_dir  # noqa: F401  (the tiny trained run)

from fedst.export import _exporter_warnings_only
from fedst.export import main as export_main

FEW_LINES = 4
"""What an export may show at INFO: its one result line, the model built, the file written."""


def test_an_export_shows_its_result_in_a_few_lines(run_dir, tmp_path, capsys, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)  # everything a terminal at the entry point's level would show
    out = tmp_path / "A.onnx"
    export_main([f"run={run_dir}", "site=A", "format=onnx", f"output={out}"])
    printed = capsys.readouterr()
    logged = [f"{r.name}: {r.getMessage()}" for r in caplog.records]
    shown = printed.out.splitlines() + printed.err.splitlines() + logged
    assert len(shown) <= FEW_LINES, shown[:10]
    assert printed.out.splitlines() == [f"wrote {out} and {out.with_suffix('.json')}"]


def test_the_exporters_warnings_still_show_and_their_levels_come_back(caplog):
    caplog.set_level(logging.INFO)
    passes = logging.getLogger("onnxscript.optimizer._constant_folding")
    before = (logging.getLogger("onnx_ir").level, logging.getLogger("onnxscript").level)
    with _exporter_warnings_only():
        passes.info("Skipping constant folding for node 'node_conv2d'")
        passes.warning("a real problem of the exporter")
        logging.getLogger("fedst.export").info("ours, at INFO")
    assert [(r.name, r.levelname) for r in caplog.records] == [
        ("onnxscript.optimizer._constant_folding", "WARNING"),
        ("fedst.export", "INFO"),
    ]
    assert (logging.getLogger("onnx_ir").level, logging.getLogger("onnxscript").level) == before
