"""docs/planner.md's "Predicted vs published" table is what benchmarks/planner_vs_published.py
prints for the presets as they are, and the presets' calibration still fits its rows."""

from __future__ import annotations

import importlib.util
import sys

from tests.conftest import REPO


def _script():
    path = REPO / "benchmarks" / "planner_vs_published.py"
    spec = importlib.util.spec_from_file_location("planner_vs_published", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_the_scripts_output():
    docs = (REPO / "docs" / "planner.md").read_text()
    start = "<!-- generated: benchmarks/planner_vs_published.py -->\n"
    shown = docs.split(start, 1)[1].split("\n<!-- end generated -->", 1)[0]
    assert shown == _script().table(), "rerun benchmarks/planner_vs_published.py into the docs"


def test_the_calibration_fits_the_rows_it_was_fitted_on():
    script = _script()
    for row in script.PUBLISHED:
        if row.fit:
            assert abs(script.predict(row) / row.value - 1) < 0.03, row.system
