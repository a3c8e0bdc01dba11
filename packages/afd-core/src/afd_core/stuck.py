"""A stuck engine, as its server's API processes see it: alive (vLLM's `errored` flag
unset, its ranks' peers up) but not moving, for longer than `stuck_after_s`
(connector_extra_config). The health patch answers 503 for it (patches/health.py).

An FFN server is stuck when one of its FFN ranks has been in one step longer than that
step's waits' bound plus stuck_after_s (`ffn_steps_stuck`): a wait for a stalled attention
peer ends within the bound (the peer is dropped), so a step that lasts longer does not move
by itself (hung in its compute or in a collective of its group, e.g. a tensor-parallel
worker stopped or cut off).

An attention server is stuck when no rank of the server ends a step while requests wait
(`StuckWatch`).

Either is stuck when one of its ranks has not rewritten its snapshot for stuck_after_s
(`ranks_not_refreshing`): a live rank rewrites it every REFRESH_S from a thread of its own,
idle or busy, so its process is stopped (SIGSTOP) or hung holding the interpreter. It
also sees an idle rank, which the two checks above cannot.

Only an API process knows its own unfinished requests. With `--api-server-count` above 1 a
health check lands on any of them, so each check also writes what this process saw (its
unfinished requests and since when they wait) next to the ranks' snapshots, and reads what
the others wrote: every process gives the same answer once the process holding the requests
has been checked once. A report counts only while no step ended after it was written (a
step since means the engine moved on; its next check says what waits now).

The wait counts from the first check that saw requests (an API process keeps no arrival
time unless vLLM's stats are on): checks every P seconds say "stuck" within
stuck_after_s + P, and never earlier.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from afd_core.metrics import REFRESH_S, write_snapshot

SUFFIX = ".waiting"  # beside the ranks' *.json snapshots, which the collector reads


@dataclass
class Waiting:
    """One API process's report: at `checked_at` it held `unfinished` requests, waiting
    since `since` (all times time.time())."""

    pid: int
    unfinished: int
    since: float | None
    checked_at: float


class StuckWatch:
    """One API process's view of its server's engine."""

    def __init__(self, after_s: float, directory: str | None = None):
        self.after_s = after_s
        self.directory = directory  # the server's metrics directory; None: this process only
        self.waiting_since: float | None = None  # the first check that saw requests

    def check(
        self,
        unfinished: int,
        last_step_at: float | None,
        now: float,
        others: list[Waiting] = (),
    ) -> str | None:
        """Why the engine is stuck, or None. `unfinished`: this process's requests;
        `last_step_at`: the newest step end of the server's attention ranks; `others`: the
        reports of the server's other API processes."""
        if unfinished == 0:
            self.waiting_since = None
        elif self.waiting_since is None:
            self.waiting_since = now
        mine = Waiting(os.getpid(), unfinished, self.waiting_since, now)
        self._report(mine)
        if self.after_s <= 0 or last_step_at is None:
            return None
        waiting = [
            w
            for w in [mine, *others]
            if w.unfinished > 0 and w.since is not None and w.checked_at >= last_step_at
        ]
        if not waiting:
            return None
        quiet = now - max(last_step_at, min(w.since for w in waiting))
        if quiet <= self.after_s:
            return None
        count = sum(w.unfinished for w in waiting)
        return (
            f"no step ended on any attention rank for {quiet:.0f} s while {count} "
            f"request(s) wait (stuck_after_s={self.after_s:g}): the engine is hung or stopped"
        )

    def _report(self, waiting: Waiting) -> None:
        if self.directory:
            path = Path(self.directory) / f"api-{waiting.pid}{SUFFIX}"
            write_snapshot(path, waiting.__dict__)


def read_reports(directory: str, belongs) -> list[Waiting]:
    """The reports in `directory` of the live processes for which `belongs(pid)` holds
    (the server's other API processes), this process's own left out."""
    found = []
    for path in Path(directory).glob(f"*{SUFFIX}"):
        try:
            w = Waiting(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if w.pid != os.getpid() and belongs(w.pid):
            found.append(w)
    return found


def ffn_steps_stuck(snapshots: list[dict], after_s: float, now: float) -> list[str]:
    """Why each FFN rank in `snapshots` (their afd_core.metrics snapshots) is stuck."""
    if after_s <= 0:
        return []
    stuck = []
    for snap in snapshots:
        if (started := snap.get("step_started_at")) is None:
            continue
        bound = float(snap.get("step_bound_s", 0.0))
        if (lasted := now - float(started)) > bound + after_s:
            stuck.append(
                f"FFN rank {snap['rank']} has been in one step for {lasted:.0f} s (its waits' "
                f"bound {bound:g} s + stuck_after_s={after_s:g}): hung or stopped"
            )
    return stuck


def ranks_not_refreshing(snapshots: list[dict], after_s: float, now: float) -> list[str]:
    """Why each rank in `snapshots` whose writer stopped rewriting it is stuck (a snapshot
    without `published_at`, relayed from a rank that writes none, says nothing)."""
    if after_s <= 0:
        return []
    bound = max(after_s, 3 * REFRESH_S)
    stuck = []
    for snap in snapshots:
        if (written := snap.get("published_at")) is None:
            continue
        if (age := now - float(written)) > bound:
            stuck.append(
                f"{snap['role']} rank {snap['rank']} has not refreshed its numbers for "
                f"{age:.0f} s (every {REFRESH_S:g} s while alive; stuck_after_s="
                f"{after_s:g}): its process is stopped or hung"
            )
    return stuck
