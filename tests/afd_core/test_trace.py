"""Step timelines (AFD_STEP_TRACE): off by default, one JSON line per event, flushed per step."""

from __future__ import annotations

import json

from afd_core.trace import StepTrace, trace_for


def test_off_unless_the_variable_is_set(monkeypatch):
    monkeypatch.delenv("AFD_STEP_TRACE", raising=False)
    t = trace_for("attention", 97)
    assert not t.enabled
    t.add("step", 0.0, 1.0)  # a no-op


def test_events_reach_the_file_at_each_step(tmp_path):
    t = StepTrace(str(tmp_path / "p.ffn0.jsonl"))
    t.add("compute", 1.0, 2.0)
    assert not (tmp_path / "p.ffn0.jsonl").exists()  # buffered until the step ends
    t.add("step", 0.5, 2.5)
    lines = [json.loads(x) for x in (tmp_path / "p.ffn0.jsonl").read_text().splitlines()]
    assert lines == [
        {"kind": "compute", "t0": 1.0, "t1": 2.0},
        {"kind": "step", "t0": 0.5, "t1": 2.5},
    ]
