"""Step timelines for measuring overlap (benchmarks): AFD_STEP_TRACE=<path prefix>.

Off unless the variable is set (then each event costs a clock read and a list append, and
each step a file append). Each process writes `<prefix>.<role><rank>.jsonl`, one JSON
object per event, flushed at the end of every step: `{"kind": "step", "t0", "t1"}` (a whole
step), `{"kind": "wait", "t0", "t1"}` (attention: blocked on the FFN rank inside a step),
`{"kind": "compute", "t0", "t1"}` (FFN: one layer/micro-batch computed). Times are
time.monotonic() seconds, comparable between processes of one machine.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time

from afd_core import envs


class StepTrace:
    def __init__(self, path: str | None):
        self.path = path
        self._events: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()
        if path:
            atexit.register(self.flush)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def add(self, kind: str, t0: float, t1: float) -> None:
        if self.path is None:
            return
        with self._lock:
            self._events.append((kind, t0, t1))
        if kind == "step":
            self.flush()

    def flush(self) -> None:
        if self.path is None:
            return
        with self._lock:
            events, self._events = self._events, []
        if not events:
            return
        with open(self.path, "a") as f:
            for kind, t0, t1 in events:
                f.write(json.dumps({"kind": kind, "t0": t0, "t1": t1}) + "\n")


_traces: dict[str, StepTrace] = {}


def trace_for(role: str, rank: int) -> StepTrace:
    """This process's trace for a role rank (a no-op trace when tracing is off)."""
    key = f"{role}{rank}"
    if key not in _traces:
        prefix = os.environ.get(envs.AFD_STEP_TRACE) or None
        _traces[key] = StepTrace(f"{prefix}.{key}.jsonl" if prefix else None)
    return _traces[key]


now = time.monotonic
