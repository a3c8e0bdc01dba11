"""A stuck engine, as its server's API processes see it: alive (vLLM's `errored` flag
unset, its ranks' peers up) but not moving, for longer than `stuck_after_s`
(connector_extra_config). The health patch answers 503 for it (patches/health.py).

An FFN server is stuck when one of its FFN ranks has been in one step longer than that
step's waits' bound plus stuck_after_s (`ffn_steps_stuck`): a wait for a stalled attention
peer ends within the bound (the peer is dropped), so a step that lasts longer does not move
by itself (hung in its compute or in a collective of its group, e.g. a tensor-parallel
worker stopped or cut off).

An attention server is stuck when one of its data-parallel ranks ends no step while
requests routed to it wait (`StuckWatch`): per DP rank, since with async DP the others
step on without it (`waiting_by_dp_rank` reads where vLLM's client routed each request).

Either is stuck when one of its ranks has not rewritten its snapshot for stuck_after_s
(`ranks_not_refreshing`): a live rank rewrites it every REFRESH_S from a thread of its own,
idle or busy, so its process is stopped (SIGSTOP) or hung holding the interpreter. It
also sees an idle rank, which the two checks above cannot.

Only an API process knows its own unfinished requests. With `--api-server-count` above 1 a
health check lands on any of them, so each check also writes what this process saw (its
unfinished requests per DP rank and since when they wait) next to the ranks' snapshots, and
reads what the others wrote: every process gives the same answer once the process holding
the requests has been checked once. A report counts for a DP rank only while no step ended
on it after the report was written (a step since means the rank moved on; its next check
says what waits now).

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


ANY_RANK = -1  # requests not routed yet: any rank's step counts for them


@dataclass
class Waiting:
    """One API process's report: at `checked_at` it held `unfinished[d]` requests routed to
    data-parallel rank d, waiting since `since[d]` (all times time.time(); keys are the
    ranks as strings, as JSON writes them)."""

    pid: int
    unfinished: dict[str, int]
    since: dict[str, float]
    checked_at: float


def waiting_by_dp_rank(engine) -> dict[int, int]:
    """This API process's unfinished requests (vLLM's AsyncLLM `engine`) per data-parallel
    rank of its server: vLLM's data-parallel client records the engine (the DP rank as two
    little-endian bytes) each request went to; a client of one engine sends all to it."""
    states = engine.output_processor.request_states
    if not states:
        return {}
    core = engine.engine_core
    routed = getattr(core, "reqs_in_flight", None)
    if routed is None:
        engine_id = getattr(core, "core_engine", None)
        dp = int.from_bytes(engine_id, "little") if isinstance(engine_id, bytes) else 0
        return {dp: len(states)}
    counts: dict[int, int] = {}
    for request_id in list(states):  # the event loop's thread adds and removes them
        engine_id = routed.get(request_id)
        dp = int.from_bytes(engine_id, "little") if engine_id is not None else ANY_RANK
        counts[dp] = counts.get(dp, 0) + 1
    return counts


def last_step_by_dp_rank(snapshots: list[dict], start_rank: int, tp: int) -> dict[int, float]:
    """The newest step end of each data-parallel rank of an attention server (its AFD
    ranks start_rank + d * tp ... + tp - 1), and of any rank (ANY_RANK)."""
    last: dict[int, float] = {}
    for snap in snapshots:
        if snap.get("last_step_at") is None:
            continue
        at = float(snap["last_step_at"])
        for dp in ((int(snap["rank"]) - start_rank) // max(tp, 1), ANY_RANK):
            last[dp] = max(last.get(dp, at), at)
    return last


class StuckWatch:
    """One API process's view of its server's engine."""

    def __init__(self, after_s: float, directory: str | None = None):
        self.after_s = after_s
        self.directory = directory  # the server's metrics directory; None: this process only
        self.waiting_since: dict[int, float] = {}  # DP rank: the first check that saw requests

    def check(
        self,
        waiting: dict[int, int],
        last_step_at: dict[int, float],
        now: float,
        others: list[Waiting] = (),
    ) -> str | None:
        """Why the engine is stuck, or None. `waiting`: this process's unfinished requests
        per data-parallel rank (`waiting_by_dp_rank`); `last_step_at`: each DP rank's
        newest step end (`last_step_by_dp_rank`); `others`: the reports of the server's
        other API processes."""
        waiting = {dp: n for dp, n in waiting.items() if n > 0}
        self.waiting_since = {dp: self.waiting_since.get(dp, now) for dp in waiting}
        mine = Waiting(
            os.getpid(),
            {str(dp): n for dp, n in waiting.items()},
            {str(dp): t for dp, t in self.waiting_since.items()},
            now,
        )
        self._report(mine)
        if self.after_s <= 0 or ANY_RANK not in last_step_at:
            return None
        stuck = []
        for dp in sorted({int(d) for w in [mine, *others] for d in w.unfinished}):
            # a rank without a snapshot of its own yet: the server's newest step
            last = last_step_at.get(dp, last_step_at[ANY_RANK])
            reports = [
                w
                for w in [mine, *others]
                if w.unfinished.get(str(dp), 0) > 0 and str(dp) in w.since and w.checked_at >= last
            ]
            if not reports:
                continue
            quiet = now - max(last, min(w.since[str(dp)] for w in reports))
            if quiet > self.after_s:
                count = sum(w.unfinished[str(dp)] for w in reports)
                where = "any attention rank" if dp == ANY_RANK else f"attention DP rank {dp}"
                stuck.append(
                    f"no step ended on {where} for {quiet:.0f} s while {count} request(s) "
                    f"wait on it (stuck_after_s={self.after_s:g}): the engine is hung or stopped"
                )
        return "; ".join(stuck) or None

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
        if not isinstance(w.unfinished, dict) or not isinstance(w.since, dict):
            continue  # another release's report
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
