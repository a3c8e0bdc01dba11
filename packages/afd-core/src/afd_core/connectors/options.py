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
    # Longest wait for every rank to join the rendezvous at start-up. Servers finish loading
    # at different times: raise it when one side loads a large model much later.
    connect_timeout_s: Seconds = Field(default=120.0, gt=0, le=3600)
    # Longest wait for a peer within one start-up step (vLLM's profiling run, compile
    # warm-up, graph captures: everything before the attention server serves). The first
    # forward compiles (torch.compile, Triton and kernel JIT), which can take many minutes
    # on a large model with a cold cache; it replaces timeout_s for those steps when longer.
    startup_timeout_s: Seconds = Field(default=1800.0, gt=0, le=86400)


class NcclOptions(GlooOptions):
    """Options of the CUDA NCCL connector: the same bounds. A data operation not done
    within timeout_s aborts the NCCL channel (the watchdog) and names the peer."""


class HcclOptions(GlooOptions):
    """Options of the Ascend HCCL connector (afd-npu): the same bounds. A data operation
    not done within timeout_s aborts the HCCL channel (the watchdog) and names the peer."""
