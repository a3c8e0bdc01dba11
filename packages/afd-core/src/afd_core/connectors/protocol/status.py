"""The per-step status message: FFN -> each attention peer, once at the end of every step.

It tells the attention rank whether the FFN half of the step it just finished was computed
(OK), failed but left the protocol in step (STEP_FAILED: the FFN rank answered the rest of
the step with zeros; the attention rank fails that step's requests and both go on), or
whether the FFN rank is leaving the deployment (ABORT: the attention rank stops too, with
the FFN rank's reason, at once), or whether it dropped this attention rank alone and serves
the others on (DROPPED, version 2: e.g. the rank sent the wrong step number, or was silent
past its bound; the attention rank takes its FFN rank as lost, with the FFN rank's reason
instead of a closed connection, and rejoins). Without it the attention side could not tell a
computed step from one answered with zeros.

Wire format (version 2): STATUS_LEN bytes; eight little-endian int64
[MAGIC, VERSION, step, code, layer, microbatch, ffn_rank, reason_len], then up to
MAX_REASON bytes of UTF-8 reason. No torch here: the connector turns the bytes into a tensor.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAGIC = 0x41464453  # "AFDS"
VERSION = 2  # 2: DROPPED
STATUS_LEN = 1024
_HEADER = struct.Struct("<8q")
MAX_REASON = STATUS_LEN - _HEADER.size


class StatusCode(enum.IntEnum):
    OK = 0
    STEP_FAILED = 1  # this step's FFN output is not valid; the deployment goes on
    ABORT = 2  # the FFN rank stops; the attention rank must stop too
    DROPPED = 3  # the FFN rank dropped this attention rank alone and serves the others on


class StatusError(RuntimeError):
    """A status message this rank cannot accept."""


@dataclass(frozen=True)
class StepStatus:
    step: int
    code: StatusCode = StatusCode.OK
    layer: int = -1  # where it failed, -1 if not at a layer
    microbatch: int = -1
    ffn_rank: int = 0
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.code == StatusCode.OK

    def encode(self) -> bytes:
        reason = self.reason.encode("utf-8", errors="replace")[:MAX_REASON]
        header = _HEADER.pack(
            MAGIC,
            VERSION,
            self.step,
            int(self.code),
            self.layer,
            self.microbatch,
            self.ffn_rank,
            len(reason),
        )
        return header + reason + bytes(STATUS_LEN - _HEADER.size - len(reason))

    def where(self) -> str:
        parts = [f"step {self.step}"]
        if self.layer >= 0:
            parts.insert(0, f"layer {self.layer}")
        if self.microbatch >= 0:
            parts.insert(1 if self.layer >= 0 else 0, f"micro-batch {self.microbatch}")
        return ", ".join(parts)


def decode_status(data: bytes, ffn_rank: int) -> StepStatus:
    who = f"status message from FFN rank {ffn_rank}"
    if len(data) != STATUS_LEN:
        raise StatusError(f"{who}: {len(data)} bytes, expected {STATUS_LEN}")
    magic, version, step, code, layer, microbatch, sender, n = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise StatusError(f"{who}: bad magic {magic:#x} (expected {MAGIC:#x})")
    if version != VERSION:
        raise StatusError(
            f"{who}: status version {version}, this rank speaks {VERSION}; run the same "
            "afd-core release on both sides"
        )
    if code not in StatusCode._value2member_map_:
        raise StatusError(f"{who}: unknown status code {code}")
    if not 0 <= n <= MAX_REASON:
        raise StatusError(f"{who}: reason length {n} out of range 0..{MAX_REASON}")
    reason = data[_HEADER.size : _HEADER.size + n].decode("utf-8", errors="replace")
    return StepStatus(step, StatusCode(code), layer, microbatch, sender, reason)
