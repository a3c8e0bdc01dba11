"""The per-step control message: attention -> FFN, before every forward pass.

It is the only thing that wakes an FFN rank, and it tells it how many rows each micro-batch
of this attention rank carries, so the FFN side knows every tensor shape before the first
layer arrives. An idle attention rank sends a HEARTBEAT message (no rows, no step: the FFN
rank's listener answers it at once with a status), so each side learns within
liveness_timeout_s that the other went silent. Wire format (version 5, VERSION): a
fixed-length vector of int64

    [MAGIC, VERSION, sender_rank, step, flags, num_microbatches, hidden_size, dtype_code,
     senders, tokens[0], ..., tokens[MAX_MICROBATCHES - 1]]

`senders`: which data-parallel ranks of the sender's attention server send this step (bit
i: DP index i), where the server agrees on it each step (step/served_together.py); 0 where
it does not. An FFN rank of an expert group whose own peers are not among them takes part
in the group's step with no rows (step/expert_group.py).

Fixed length means one receive of known size; a malformed or mismatched message is a clear
error naming the sender and the field, never a hang or a wrong shape. No torch here: the
connector turns the list into a tensor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from afd_core.capabilities import MAX_MICROBATCHES  # a message holds this many row counts

MAGIC = 0x41464443  # "AFDC"
# 2: step numbers are checked, DUMMY/PROFILE flags, a status message ends each step;
# 3: the STARTUP flag (start-up steps are bounded by startup_timeout_s on both sides);
# 4: HEARTBEAT messages between steps (liveness_timeout_s);
# 5: the senders word (an attention server's DP ranks that send the step)
VERSION = 5
HEADER_LEN = 9
MESSAGE_LEN = HEADER_LEN + MAX_MICROBATCHES

# dtype names as torch spells them; codes are part of the wire format
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}


class ControlFlag(enum.IntFlag):
    NONE = 0
    WARMUP = 1  # a warm-up forward: shapes are real, results are discarded
    CAPTURE = 2  # the forward is being captured into a graph (accelerator paths)
    SHUTDOWN = 4  # the sender leaves the deployment; no layer exchange follows
    DUMMY = 8  # no real requests: a data-parallel padding step or an idle rank's dummy batch
    PROFILE = 16  # vLLM's memory-profiling forward (max-size dummy batch)
    STARTUP = 32  # before the attention server serves: bounded by startup_timeout_s
    HEARTBEAT = 64  # an idle rank is alive; no step, the FFN rank's listener answers at once


KNOWN_FLAGS = int(
    ControlFlag.WARMUP
    | ControlFlag.CAPTURE
    | ControlFlag.SHUTDOWN
    | ControlFlag.DUMMY
    | ControlFlag.PROFILE
    | ControlFlag.STARTUP
    | ControlFlag.HEARTBEAT
)
NO_ROWS = ControlFlag.SHUTDOWN | ControlFlag.HEARTBEAT  # messages that carry no step


class ControlError(RuntimeError):
    """A control message that this rank cannot accept."""


@dataclass(frozen=True)
class ControlMessage:
    sender_rank: int  # attention role rank
    step: int
    tokens: tuple[int, ...]  # rows per micro-batch, in micro-batch order
    hidden_size: int
    dtype: str
    flags: ControlFlag = ControlFlag.NONE
    senders: int = 0  # bit i: DP index i of the sender's server sends this step; 0: not told

    @property
    def num_microbatches(self) -> int:
        return len(self.tokens)

    @property
    def is_shutdown(self) -> bool:
        return bool(self.flags & ControlFlag.SHUTDOWN)

    @property
    def is_heartbeat(self) -> bool:
        return bool(self.flags & ControlFlag.HEARTBEAT)

    def encode(self) -> list[int]:
        if not 1 <= len(self.tokens) <= MAX_MICROBATCHES and not self.flags & NO_ROWS:
            raise ControlError(
                f"control message: {len(self.tokens)} micro-batches; allowed 1..{MAX_MICROBATCHES}"
            )
        if any(t < 0 for t in self.tokens):
            raise ControlError(f"control message: negative token count in {self.tokens}")
        if self.dtype not in DTYPE_CODES:
            raise ControlError(
                f"control message: dtype {self.dtype!r} cannot be sent; allowed: "
                + ", ".join(DTYPE_CODES)
            )
        if not 0 <= self.senders < 1 << 62:
            raise ControlError(f"control message: senders={self.senders}; allowed 0..2**62-1")
        padded = list(self.tokens) + [0] * (MAX_MICROBATCHES - len(self.tokens))
        return [
            MAGIC,
            VERSION,
            self.sender_rank,
            self.step,
            int(self.flags),
            len(self.tokens),
            self.hidden_size,
            DTYPE_CODES[self.dtype],
            self.senders,
            *padded,
        ]


@dataclass(frozen=True)
class Expectation:
    """What the receiving FFN rank requires of a message from one peer."""

    sender_rank: int
    hidden_size: int
    dtype: str
    max_tokens: int | None = None  # per micro-batch; None = unchecked


def is_heartbeat(words: list[int]) -> bool:
    """Whether received words claim to be a heartbeat (decode checks the rest)."""
    return len(words) == MESSAGE_LEN and words[4] >= 0 and bool(words[4] & ControlFlag.HEARTBEAT)


def awaits_status(words: list[int]) -> bool:
    """Whether received words claim to be a step, which its sender waits to see served
    (not a heartbeat, not a goodbye; decode checks the rest)."""
    return (
        len(words) == MESSAGE_LEN
        and words[4] >= 0
        and not words[4] & (ControlFlag.HEARTBEAT | ControlFlag.SHUTDOWN)
    )


def decode(words: list[int], expect: Expectation) -> ControlMessage:
    """Parse and check a received message; ControlError names the peer and the field."""
    who = f"control message from attention rank {expect.sender_rank}"
    if len(words) != MESSAGE_LEN:
        raise ControlError(f"{who}: {len(words)} words, expected {MESSAGE_LEN}")
    magic, version, sender, step, flags, n_mb, hidden, dtype_code, senders = words[:HEADER_LEN]
    if magic != MAGIC:
        raise ControlError(
            f"{who}: bad magic {magic:#x} (expected {MAGIC:#x}); is another program using "
            "the AFD port, or are the two sides different AFD builds?"
        )
    if version != VERSION:
        raise ControlError(
            f"{who}: protocol version {version}, this rank speaks {VERSION}; run the same "
            "afd-core release on both sides"
        )
    if sender != expect.sender_rank:
        raise ControlError(
            f"{who}: it says it comes from attention rank {sender}; check that every "
            "attention server has its own rank (data-parallel rank) and the same "
            "num_attention_ranks/num_ffn_ranks"
        )
    if flags & ~KNOWN_FLAGS or flags < 0:
        raise ControlError(f"{who}: unknown flags {flags:#x}")
    flag = ControlFlag(flags)
    if senders < 0:
        raise ControlError(f"{who}: senders={senders}; allowed a non-negative bit mask")
    if flag & NO_ROWS:
        if n_mb or any(words[HEADER_LEN:]):
            raise ControlError(f"{who}: a {flag!r} message carries rows ({n_mb} micro-batches)")
        return ControlMessage(sender, step, (), hidden, DTYPE_NAMES.get(dtype_code, "?"), flag)
    if not 1 <= n_mb <= MAX_MICROBATCHES:
        raise ControlError(f"{who}: num_microbatches={n_mb}; allowed 1..{MAX_MICROBATCHES}")
    if hidden != expect.hidden_size:
        raise ControlError(
            f"{who}: hidden_size={hidden}, but this FFN rank's model has "
            f"hidden_size={expect.hidden_size}; both sides must serve the same checkpoint"
        )
    if DTYPE_NAMES.get(dtype_code) != expect.dtype:
        raise ControlError(
            f"{who}: dtype={DTYPE_NAMES.get(dtype_code, dtype_code)!r}, but this FFN rank "
            f"runs {expect.dtype!r}; start both sides with the same --dtype"
        )
    tokens = tuple(words[HEADER_LEN : HEADER_LEN + n_mb])
    if any(t < 0 for t in tokens):
        raise ControlError(f"{who}: negative token count in {tokens}")
    if expect.max_tokens is not None and any(t > expect.max_tokens for t in tokens):
        raise ControlError(
            f"{who}: {max(tokens)} tokens in one micro-batch exceed the {expect.max_tokens} "
            "that rank announced at start-up (its --max-num-batched-tokens)"
        )
    if any(words[HEADER_LEN + n_mb :]):
        raise ControlError(f"{who}: non-zero padding after {n_mb} micro-batches")
    return ControlMessage(sender, step, tokens, hidden, expect.dtype, flag, senders)
