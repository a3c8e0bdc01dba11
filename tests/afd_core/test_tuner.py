"""The per-step micro-batch chooser (num_microbatches "auto"): it measures m = 1, 2, ...
while each is faster than the last (each m's first steps unmeasured, then the median of as
many measurements of each), then runs the fastest, re-measures its neighbours now and then,
and keeps sizes and kinds of steps apart."""

from __future__ import annotations

import pytest

from afd_core.step.tuner import MicrobatchTuner, bucket_of


def run(tuner, tokens, cost, steps):
    """`steps` steps of `tokens`; cost(m) seconds per token. The m chosen, in order."""
    chosen = []
    for _ in range(steps):
        c = tuner.choose(tokens)
        chosen.append(c.microbatches)
        tuner.observe(c, cost(c.microbatches) * c.tokens)
    return chosen


def slow_first_split_step(costs, factor):
    """cost(m) for `run`: costs[m], but the first step of each m >= 2 takes `factor` times as
    long (a split step's new shapes, allocator growth, compiles; m = 1's were met before)."""
    met = set()

    def cost(m):
        first = m >= 2 and m not in met
        met.add(m)
        return costs[m] * (factor if first else 1.0)

    return cost


def test_measures_m_up_to_the_first_slower_one_then_runs_the_fastest():
    t = MicrobatchTuner(4, warmup=1, window=3, explore_every=40)
    costs = {1: 1.0, 2: 0.7, 3: 0.8, 4: 0.9}
    chosen = run(t, [1] * 64, costs.__getitem__, 400)
    # m = 3 is slower than m = 2, so m = 4 (slower still) is never run
    assert chosen[:12] == [1] * 4 + [2] * 4 + [3] * 4
    after = chosen[12:]
    assert after.count(2) / len(after) > 0.95  # then the fastest, but for re-measures
    assert set(after) == {1, 2, 3}  # its neighbours are measured again in time
    assert t.best([1] * 64) == 2


def test_goes_on_to_larger_m_while_they_pay():
    t = MicrobatchTuner(4, warmup=1, window=1)
    chosen = run(t, [1] * 128, {1: 1.0, 2: 0.8, 3: 0.7, 4: 0.65}.__getitem__, 100)
    assert chosen[:8] == [1, 1, 2, 2, 3, 3, 4, 4] and t.best([1] * 128) == 4


def test_never_splits_where_splitting_does_not_pay():
    t = MicrobatchTuner(4)
    chosen = run(t, [1] * 4, lambda m: 1.0 + 0.2 * (m - 1), 300)
    # the defaults: each m one step unmeasured, then five measured
    assert chosen[:12] == [1] * 6 + [2] * 6 and 3 not in chosen  # m = 2 did not pay
    assert chosen[12:].count(1) / len(chosen[12:]) > 0.97
    assert t.best([1] * 4) == 1


def test_follows_a_change_in_what_pays():
    t = MicrobatchTuner(4, warmup=1, window=3, explore_every=10)
    run(t, [1] * 32, {1: 1.0, 2: 1.2, 3: 1.3, 4: 1.4}.__getitem__, 50)
    assert t.best([1] * 32) == 1
    # the batch's contexts grew: splitting pays now, m = 2 and then m = 3 are found
    chosen = run(t, [1] * 32, {1: 1.0, 2: 0.8, 3: 0.7, 4: 0.9}.__getitem__, 200)
    assert t.best([1] * 32) == 3 and 4 in chosen
    run(t, [1] * 32, {1: 1.0, 2: 1.5, 3: 1.6, 4: 1.7}.__getitem__, 200)  # and back
    assert t.best([1] * 32) == 1


def test_steps_of_other_sizes_and_kinds_are_measured_apart():
    t = MicrobatchTuner(4)
    run(t, [1] * 8, {1: 1.0, 2: 1.2, 3: 1.3, 4: 1.4}.__getitem__, 50)
    run(t, [1] * 128, {1: 1.0, 2: 0.6, 3: 0.7, 4: 0.8}.__getitem__, 50)
    run(t, [40, 40, 1, 1], {1: 1.0, 2: 0.5, 3: 0.9, 4: 0.9}.__getitem__, 50)
    assert (t.best([1] * 8), t.best([1] * 128), t.best([40, 40, 1, 1])) == (1, 2, 2)
    assert bucket_of([1] * 8) != bucket_of([1] * 16)  # ~1.41x apart
    assert bucket_of([1] * 8)[0] and not bucket_of([7, 1])[0]  # decode only or not
    report = t.as_dict()
    assert report["decode~8"]["steps"] == 50 and report["decode~8"]["by_microbatches"]["1"][0] > 0


def test_at_most_one_microbatch_per_request():
    t = MicrobatchTuner(4)
    assert {run(t, [5, 5], lambda m: 1.0, 20)[i] for i in range(20)} <= {1, 2}
    assert run(MicrobatchTuner(4), [9], lambda m: 1.0, 5) == [1] * 5


@pytest.mark.parametrize("factor", [1.5, 10])
def test_a_slow_first_split_step_does_not_decide(factor):
    """From a cold start the first step at m = 2 is slow for one-off reasons: it is not
    measured, so m = 2 and then m = 3 (the fastest) are still found, in the same steps."""
    t = MicrobatchTuner(4)
    costs = {1: 1.0, 2: 0.8, 3: 0.7, 4: 0.9}
    chosen = run(t, [1] * 64, slow_first_split_step(costs, factor), 100)
    assert t.best([1] * 64) == 3 and chosen[24:].count(3) / len(chosen[24:]) > 0.95
    assert chosen[:24] == [1] * 6 + [2] * 6 + [3] * 6 + [4] * 6


def test_slow_steps_later_do_not_move_the_choice():
    """Two slow steps in a row at the m running (another process took the core) change
    nothing: the m running and its neighbours are each the median of as many steps."""
    t = MicrobatchTuner(4, explore_every=50)
    costs = {1: 1.0, 2: 0.8, 3: 0.9, 4: 1.0}
    run(t, [1] * 64, costs.__getitem__, 100)
    assert t.best([1] * 64) == 2
    run(t, [1] * 64, {**costs, 2: 8.0}.__getitem__, 2)
    chosen = run(t, [1] * 64, costs.__getitem__, 100)
    assert chosen.count(2) / len(chosen) > 0.95 and t.best([1] * 64) == 2


@pytest.mark.parametrize(
    "kw", [{"max_microbatches": 0}, {"warmup": -1}, {"window": 0}, {"explore_every": 1}]
)
def test_bad_settings_are_named(kw):
    args = {"max_microbatches": 4, **kw}
    with pytest.raises(ValueError, match="MicrobatchTuner"):
        MicrobatchTuner(**args)
