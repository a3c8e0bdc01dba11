"""Connector-specific options (`connector_extra_config`), one closed schema per connector."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _coerce_float(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("expected a number of seconds")
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            pass
    raise ValueError("expected a number of seconds")


Seconds = Annotated[float, BeforeValidator(_coerce_float)]


class GlooOptions(BaseModel):
    """Options of the CPU gloo connector."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Longest wait for a peer (rendezvous, a control message, one layer's tensors).
    timeout_s: Seconds = Field(default=120.0, gt=0, le=3600)
    # Longest wait to connect once the peers are there: a group's channels, the handshake,
    # a restarted rank's rejoin.
    connect_timeout_s: Seconds = Field(default=120.0, gt=0, le=3600)
    # Start-up's own bound, for what a large model makes long:
    # - the wait for the rendezvous and for every rank of the deployment, while the other
    #   servers still load their weights (an FFN server loads ~650 GB of DeepSeek-V3's
    #   experts: 1,300 s at 500 MB/s, longer from slow network storage);
    # - each start-up step (vLLM's profiling run, compile warm-up, graph captures: everything
    #   before the attention server serves), whose first forward compiles (torch.compile,
    #   Triton and kernel JIT), minutes on a large model with a cold cache; it replaces
    #   timeout_s for those steps when longer.
    startup_timeout_s: Seconds = Field(default=3600.0, gt=0, le=86400)
    # How long a formed link may stay silent: an idle attention rank sends a heartbeat every
    # liveness_timeout_s / 3 and its FFN rank answers it, so a peer that is powered off,
    # cut off or stopped (SIGSTOP) between steps is lost within this bound on both sides,
    # and a restarted replacement is admitted (where links fail alone: survives_peer_loss).
    liveness_timeout_s: Seconds = Field(default=30.0, ge=3, le=3600)
    # After an FFN loss, how long a restarted FFN rank 0 waits for the ranks that have not
    # come back yet once the first surviving attention rank returned to it: then the
    # deployment forms with the ranks present, and the others join when they come
    # (admission/formation.py). Start-up proper still waits startup_timeout_s for every rank.
    recovery_grace_s: Seconds = Field(default=15.0, ge=1, le=3600)
    # How long a server's engine may stay alive but not moving before its /health answers
    # 503 (afd_core/stuck.py): an attention server's requests waiting on a data-parallel
    # rank while that rank ends no step; an FFN rank in one step past that step's bound
    # plus this; a rank that stopped rewriting its metrics snapshot (at least 15 s: a
    # stopped or hung process). Make it longer than the longest step (a long prefill on a slow device; a
    # wait for a P/D transfer); 0 turns it off.
    stuck_after_s: Seconds = Field(default=60.0, ge=0, le=86400)


class NcclOptions(GlooOptions):
    """Options of the CUDA NCCL connector: the same bounds. A data operation not done
    within timeout_s aborts the NCCL channel (the watchdog) and names the peer."""


class HcclOptions(GlooOptions):
    """Options of the Ascend HCCL connector (afd-npu): the same bounds. A data operation
    not done within timeout_s aborts the HCCL channel (the watchdog) and names the peer."""
