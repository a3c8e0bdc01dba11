"""The per-step status message FFN -> attention: round trip, limits, malformed input."""

from __future__ import annotations

import struct

import pytest

from afd_core.connectors.protocol.status import (
    MAX_REASON,
    STATUS_LEN,
    StatusCode,
    StatusError,
    StepStatus,
    decode_status,
)


def test_round_trip_and_where():
    s = StepStatus(7, StatusCode.STEP_FAILED, 3, 1, 2, "RuntimeError: boom ✓")
    data = s.encode()
    assert len(data) == STATUS_LEN
    assert decode_status(data, 2) == s
    assert s.where() == "layer 3, micro-batch 1, step 7"
    assert StepStatus(4).where() == "step 4" and StepStatus(4).ok


def test_version_2_tells_a_dropped_rank_why():
    from afd_core.connectors.protocol.status import VERSION

    s = StepStatus(9, StatusCode.DROPPED, ffn_rank=1, reason="attention rank 3 announced step 11")
    data = s.encode()
    assert VERSION == 2 and struct.unpack_from("<q", data, 8) == (2,)
    assert decode_status(data, 1) == s and not s.ok


def test_a_status_of_another_version_is_refused_naming_both():
    data = bytearray(StepStatus(1).encode())
    data[8:16] = struct.pack("<q", 1)
    with pytest.raises(StatusError, match="status version 1, this rank speaks 2"):
        decode_status(bytes(data), 0)


def test_long_reasons_are_cut_to_fit():
    s = decode_status(StepStatus(1, StatusCode.ABORT, reason="x" * 5000).encode(), 0)
    assert s.reason == "x" * MAX_REASON and s.code is StatusCode.ABORT


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda b: b[:-1], "1023 bytes, expected 1024"),
        (lambda b: struct.pack("<q", 1) + b[8:], "bad magic"),
        (lambda b: b[:8] + struct.pack("<q", 9) + b[16:], "status version 9"),
        (lambda b: b[:24] + struct.pack("<q", 7) + b[32:], "unknown status code 7"),
        (lambda b: b[:56] + struct.pack("<q", 5000) + b[64:], "reason length 5000"),
    ],
)
def test_malformed_status_is_a_clear_error(mutate, match):
    with pytest.raises(StatusError, match=f"status message from FFN rank 3: .*{match}"):
        decode_status(mutate(StepStatus(1).encode()), 3)
