"""Micro-batches chosen per step (`afd.num_microbatches: "auto"`): m in 1..max from what
this attention rank measured on recent steps of the same kind and size.

DBO pays only where a side's per-layer compute is large enough for the overlap to beat the
cost of more, smaller exchanges (on this machine about 1 ms a side; docs/performance),
which depends on the batch, the context, the model and the hardware. So instead of a
formula with constants that are wrong somewhere, each rank measures: a step's time from
its plan to the forward's end (the attention metadata vLLM builds per micro-batch,
attention compute, the exchanges and the waits for the FFN side, as the step engine runs
them) per token, for each m, in buckets of steps alike (decode-only or not, total tokens
in steps of about 1.41x).

Per bucket it runs m = 1 for `warmup` + `window` steps, then m = 2 as many, and goes on to
m + 1 only while the last m was faster than the one before: the step time over m falls
while the overlap gains more than the extra exchanges cost and rises after, so past the
first m that is slower, larger ones are slower still. The first `warmup` steps of each m
are not measured (the first split steps of a size meet new shapes, allocator growth and
kernel compiles, and one slow step must not rule an m out); an m's cost is the median of
its last `window` measurements, so every m is compared on as many measurements as every
other, and a slow step or two among them do not decide. Then it runs the m with the lowest
cost, changing m only for one at least `SWITCH_MARGIN` faster (so noise does not flip it);
every `explore_every`-th step of a bucket re-measures a neighbour of that m (the one
measured longest ago), so a change (longer contexts, a busier FFN rank) is followed, and a
neighbour that becomes faster opens the next m to measuring. The cost: `warmup` + `window`
steps for each m measured once (at least m = 1 and 2), then one step in `explore_every`.

A split is still at request boundaries (step/split.py), so every m gives the tokens a fixed
m gives. Pure Python: unit-tested without vLLM.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

# the first steps of each m in a bucket, run but not measured: one-off costs (new shapes,
# allocator growth, compiles) would count against the m that happened to meet them
WARMUP_STEPS = 1
# measurements of each m compared, the median of its last this many: two slow steps among
# them (another process, a page fault) do not move it
WINDOW = 5
EXPLORE_EVERY = 50  # then one step in this many re-measures a neighbouring m
# another m replaces the one running only when this much faster: step times on a shared
# machine move by a few percent from step to step, and each switch runs a slower m a while
SWITCH_MARGIN = 0.03


def bucket_of(tokens_per_request: Sequence[int]) -> tuple[bool, int]:
    """(decode only, size class): steps whose total tokens are within ~1.41x share one."""
    total = max(1, sum(tokens_per_request))
    return all(t == 1 for t in tokens_per_request), round(2 * math.log2(total))


def bucket_name(bucket: tuple[bool, int]) -> str:
    """A bucket as `as_dict` names it: "decode~64", "mixed~181"."""
    decode, size = bucket
    return f"{'decode' if decode else 'mixed'}~{2 ** (size / 2):.0f}"


@dataclass
class _Arm:
    steps: int = 0  # steps run at this m, warm-up included
    # seconds per token of the last measured steps (a deque bounded to the window)
    measured: deque[float] = field(default_factory=deque)
    last_step: int = 0  # the bucket's step count at the last step run at this m

    def seconds_per_token(self) -> float:
        """The median of the last measurements (0 while none measured)."""
        return statistics.median(self.measured) if self.measured else 0.0


@dataclass
class _Bucket:
    steps: int = 0
    arms: dict[int, _Arm] = field(default_factory=dict)
    running: int = 0  # the m chosen as the fastest last time (0: none yet)


@dataclass(frozen=True)
class Choice:
    """What the tuner picked for one step, for `observe` after it ran."""

    bucket: tuple[bool, int]
    microbatches: int
    tokens: int


class MicrobatchTuner:
    def __init__(
        self,
        max_microbatches: int,
        warmup: int = WARMUP_STEPS,
        window: int = WINDOW,
        explore_every: int = EXPLORE_EVERY,
    ):
        if max_microbatches < 1 or warmup < 0 or window < 1 or explore_every < 2:
            raise ValueError(
                f"MicrobatchTuner(max_microbatches={max_microbatches}, warmup={warmup}, "
                f"window={window}, explore_every={explore_every}): allowed >= 1, >= 0, >= 1 "
                "and >= 2"
            )
        self.max_microbatches = max_microbatches
        self.warmup = warmup
        self.window = window
        self.explore_every = explore_every
        self._buckets: dict[tuple[bool, int], _Bucket] = {}
        self._lock = threading.Lock()

    def choose(self, tokens_per_request: Sequence[int]) -> Choice:
        """m for a step with these scheduled tokens per request (at most one per request)."""
        key = bucket_of(tokens_per_request)
        candidates = range(1, min(self.max_microbatches, len(tokens_per_request)) + 1)
        with self._lock:
            b = self._buckets.setdefault(key, _Bucket())
            b.steps += 1
            for m in candidates:
                b.arms.setdefault(m, _Arm(measured=deque(maxlen=self.window)))
            m = self._pick(b, list(candidates))
        return Choice(key, m, sum(tokens_per_request))

    def _warm(self, b: _Bucket, m: int) -> bool:
        return len(b.arms[m].measured) == self.window

    def _cost(self, b: _Bucket, m: int) -> float:
        return b.arms[m].seconds_per_token()

    def _measured(self, b: _Bucket, candidates: list[int]) -> tuple[list[int], int | None]:
        """(the m measured enough, the next m to measure or None): m = 1, 2, then m + 1
        while m was faster than m - 1."""
        done = []
        for m in candidates:
            if not self._warm(b, m):
                opens = m <= 2 or self._cost(b, m - 1) < self._cost(b, m - 2)
                return done, (m if opens else None)
            done.append(m)
        return done, None

    def _pick(self, b: _Bucket, candidates: list[int]) -> int:
        measured, next_m = self._measured(b, candidates)
        if next_m is not None:
            return next_m
        cost = {m: self._cost(b, m) for m in measured}
        best = min(measured, key=cost.get)
        if b.running in measured and cost[best] > cost[b.running] * (1 - SWITCH_MARGIN):
            best = b.running
        b.running = best
        if b.steps % self.explore_every == 0:
            near = [m for m in (best - 1, best + 1) if m in measured]
            if near:
                return min(near, key=lambda m: b.arms[m].last_step)
        return best

    def observe(self, choice: Choice, seconds: float) -> None:
        """The forward time of the step `choice` was made for."""
        if seconds <= 0 or choice.tokens <= 0:
            return
        with self._lock:
            b = self._buckets[choice.bucket]
            arm = b.arms[choice.microbatches]
            arm.steps += 1
            arm.last_step = b.steps
            if arm.steps > self.warmup:
                arm.measured.append(seconds / choice.tokens)

    def best(self, tokens_per_request: Sequence[int]) -> int | None:
        """The m this tuner would run for such a step once measured (None: not yet)."""
        with self._lock:
            b = self._buckets.get(bucket_of(tokens_per_request))
            if b is None:
                return None
            candidates = [m for m in b.arms if m <= len(tokens_per_request)]
            measured, next_m = self._measured(b, sorted(candidates))
            if next_m is not None or not measured:
                return None
            return min(measured, key=lambda m: self._cost(b, m))

    def as_dict(self) -> dict:
        """Per bucket: steps seen, and per m the steps run at it (warm-up included) and its
        microseconds per token (0 while none measured)."""
        with self._lock:
            return {
                bucket_name(key): {
                    "steps": b.steps,
                    "by_microbatches": {
                        str(m): [a.steps, round(a.seconds_per_token() * 1e6, 2)]
                        for m, a in sorted(b.arms.items())
                    },
                }
                for key, b in sorted(self._buckets.items())
            }
