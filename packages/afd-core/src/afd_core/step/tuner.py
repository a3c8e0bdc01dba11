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

Per bucket it runs m = 1 a few times (`warmup`), then m = 2, and goes on to m + 1 only
while the last m was faster than the one before: the step time over m falls while the
overlap gains more than the extra exchanges cost and rises after, so past the first m that
is slower, larger ones are slower still. Then it runs the m with the lowest moving average,
changing m only for one at least `SWITCH_MARGIN` faster (so noise does not flip it); every
`explore_every`-th step of a bucket re-measures a neighbour of that m (the one measured
longest ago), so a change (longer contexts, a busier FFN rank) is followed, and a
neighbour that becomes faster opens the next m to measuring. The cost: `warmup` steps for
each m measured once (at least m = 1 and 2), then one step in `explore_every`.

A split is still at request boundaries (step/split.py), so every m gives the tokens a fixed
m gives. Pure Python: unit-tested without vLLM.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

WARMUP_STEPS = 3  # measurements of each m in a bucket before choosing
EXPLORE_EVERY = 50  # then one step in this many re-measures a neighbouring m
SMOOTHING = 0.2  # weight of a new measurement in the moving average
# another m replaces the one running only when this much faster: step times on a shared
# machine move by a few percent from step to step, and each switch runs a slower m a while
SWITCH_MARGIN = 0.03


def bucket_of(tokens_per_request: Sequence[int]) -> tuple[bool, int]:
    """(decode only, size class): steps whose total tokens are within ~1.41x share one."""
    total = max(1, sum(tokens_per_request))
    return all(t == 1 for t in tokens_per_request), round(2 * math.log2(total))


@dataclass
class _Arm:
    samples: int = 0
    seconds_per_token: float = 0.0
    last_step: int = 0  # the bucket's step count at the last measurement


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
        explore_every: int = EXPLORE_EVERY,
        smoothing: float = SMOOTHING,
    ):
        if max_microbatches < 1 or warmup < 1 or explore_every < 2 or not 0 < smoothing <= 1:
            raise ValueError(
                f"MicrobatchTuner(max_microbatches={max_microbatches}, warmup={warmup}, "
                f"explore_every={explore_every}, smoothing={smoothing}): allowed >= 1, >= 1, "
                ">= 2 and 0 < smoothing <= 1"
            )
        self.max_microbatches = max_microbatches
        self.warmup = warmup
        self.explore_every = explore_every
        self.smoothing = smoothing
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
                b.arms.setdefault(m, _Arm())
            m = self._pick(b, list(candidates))
        return Choice(key, m, sum(tokens_per_request))

    def _warm(self, b: _Bucket, m: int) -> bool:
        return b.arms[m].samples >= self.warmup

    def _cost(self, b: _Bucket, m: int) -> float:
        return b.arms[m].seconds_per_token

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
        best = min(measured, key=lambda m: self._cost(b, m))
        if b.running in measured and self._cost(b, best) > self._cost(b, b.running) * (
            1 - SWITCH_MARGIN
        ):
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
        per_token = seconds / choice.tokens
        with self._lock:
            b = self._buckets[choice.bucket]
            arm = b.arms[choice.microbatches]
            if arm.samples == 0:
                arm.seconds_per_token = per_token
            else:
                arm.seconds_per_token += self.smoothing * (per_token - arm.seconds_per_token)
            arm.samples += 1
            arm.last_step = b.steps

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
        """Per bucket: steps seen, and per m the samples and microseconds per token."""
        with self._lock:
            return {
                f"{'decode' if decode else 'mixed'}~{2 ** (size / 2):.0f}": {
                    "steps": b.steps,
                    "by_microbatches": {
                        str(m): [a.samples, round(a.seconds_per_token * 1e6, 2)]
                        for m, a in sorted(b.arms.items())
                    },
                }
                for (decode, size), b in sorted(self._buckets.items())
            }
