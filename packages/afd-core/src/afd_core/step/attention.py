"""The attention side of a step: announce it, run its micro-batches, end it or clean it up.

One step = one control message (rows per micro-batch, flags), the micro-batches' forward
passes (one runs in the calling thread; several run on the MicrobatchExecutor, switching at
the DBO yield op, or all in one call to vLLM's UBatchWrapper, which switches at the same
op), and the FFN rank's status. A failure inside the step on this rank
(attention compute, a micro-batch thread) is finished in protocol with rows of zeros
(`abort_step`; a graph capture, where nothing moved, with the status only) and raised as
AFDStepError: that step's requests fail and the next step runs.
A failure the transport cannot survive is AFDPeerError: the deployment stops. So is a
local failure on an attention server with tensor parallelism (`local_failure_fatal`): its
sibling TP ranks are still inside that step's collectives (the sequence split's
all-gather), and this rank's next collective would pair with one of theirs (review M7:
a hang, or, with equal sizes, silently wrong outputs); the step is still finished in
protocol with the FFN rank first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from afd_core.connectors.base import (
    ATTENTION_WAIT_FACTOR,
    AFDConnector,
    AFDPeerError,
    AFDStepError,
)
from afd_core.connectors.protocol.control import ControlFlag
from afd_core.log import get_logger
from afd_core.step.microbatch import MicrobatchExecutor, MicrobatchStalled
from afd_core.step.served_together import ServedTogether
from afd_core.trace import now, trace_for

logger = get_logger(__name__)

# set on the ModelRunnerOutput of a step that failed in AFD but left the protocol in step:
# the scheduler (patches/step_failure.py) then fails exactly that step's requests
STEP_FAILURE_ATTR = "afd_step_failure"


class AttentionStepDriver:
    def __init__(self, connector: AFDConnector, executor: MicrobatchExecutor | None = None):
        self.connector = connector
        self.executor = executor or MicrobatchExecutor()
        self.trace = trace_for("attention", connector.role_rank)
        # a step whose micro-batches stop making progress fails after this: every exchange
        # of an attention rank ends (with its data or its error) within
        # ATTENTION_WAIT_FACTOR x timeout_s (connectors/p2p.py), a micro-batch's own compute
        # between two is not bounded; one step timeout more tells them apart
        step_s = _step_timeout_s(connector)
        self.stall_timeout_s = None if step_s is None else (ATTENTION_WAIT_FACTOR + 1) * step_s
        self.startup_timeout_s = _step_timeout_s(connector, "startup_timeout_s")
        if self.startup_timeout_s is not None and self.stall_timeout_s is not None:
            self.startup_timeout_s = max(self.startup_timeout_s, self.stall_timeout_s)
        # set by the role where the server's DP ranks are served together (served_together.py)
        self.served_together: ServedTogether | None = None

    def run(
        self,
        rows: Sequence[int],
        jobs: Sequence[Callable[[], Any]],
        flags: int = 0,
        replayed: bool = False,
        whole: bool = False,
    ) -> list[Any]:
        """Run one step whose micro-batch i has rows[i] rows and is computed by jobs[i];
        `whole`: one job computes every micro-batch (vLLM's UBatchWrapper runs them);
        `replayed`: the job replays a device graph (the exchanges ran without Python)."""
        if len(jobs) != (1 if whole else len(rows)):
            raise ValueError(f"{len(jobs)} micro-batch jobs for {len(rows)} announced")
        conn = self.connector
        t0 = now()
        if self.served_together is not None:
            self.served_together.check(conn)  # every DP rank of the server, every step
        msg = conn.begin_step(tuple(rows), flags)
        stall_s = self.startup_timeout_s if flags & ControlFlag.STARTUP else self.stall_timeout_s
        try:
            if len(jobs) == 1:
                results = [jobs[0]()]
            else:
                results = self.executor.run(jobs, stall_timeout_s=stall_s)
            if replayed:
                conn.mark_exchanged()
            conn.end_step()
            self.trace.add("step", t0, now())
            return results
        except (AFDPeerError, AFDStepError):
            raise
        except MicrobatchStalled as exc:
            # the stuck thread may still issue this step's exchanges: no abort in protocol
            raise AFDPeerError(
                f"attention rank {conn.role_rank}: step {msg.step}: {exc}; this rank "
                "cannot stay in step with its FFN rank"
            ) from None
        except BaseException as exc:
            try:
                stopped = conn.abort_step()
            except AFDPeerError as fatal:
                raise fatal from exc
            cleanup = (
                "both sides recorded it and nothing moved"
                if msg.flags & ControlFlag.CAPTURE
                else "the rest of the step was exchanged as zeros"
            )
            if getattr(conn, "local_failure_fatal", False):
                raise AFDPeerError(
                    f"attention rank {conn.role_rank}: step {msg.step} failed on this rank "
                    f"({stopped}): {type(exc).__name__}: {exc}; {cleanup}, but this server's "
                    "other tensor-parallel ranks are still in the step's collectives, which "
                    "this rank cannot rejoin in step: the server stops (restart it)"
                ) from exc
            raise AFDStepError(
                f"attention rank {conn.role_rank}: step {msg.step} failed on this rank "
                f"({stopped}): {type(exc).__name__}: {exc}; {cleanup}, so the FFN rank is "
                "in step for the next one"
            ) from exc

    def close(self) -> None:
        self.executor.close()


def _step_timeout_s(connector, name: str = "timeout_s") -> float | None:
    try:
        return float(getattr(connector.config.extra(), name))
    except (AttributeError, TypeError, ValueError):
        return None  # a connector without a step timeout (test doubles)
