"""Attention ranks whose FFN ranks are one expert group are served again together.

An FFN server with data parallelism is an expert group (step/expert_group.py): its members
run every step together, so each waits, in the group's agreement, for the others' attention
peers' steps. Those peers are the data-parallel ranks of one attention server, which vLLM
runs in lockstep (every forward together, dummy batches included).

When the expert group's server is restarted, each attention rank finds its new link on its
own (admission/ffn_return.py: a watch per rank, retrying every second). A rank back one
step before its sibling sends that step to its member, which waits in the group's
agreement for the sibling's member; the sibling began the same step not yet served, failed
it at once, and waits in vLLM's DP synchronisation for the first rank to finish. Nothing
moves until the agreement's bound (timeout_s) breaks the re-formed group, and the FFN
server stops again.

So on such a server every step begins with one small all-reduce over vLLM's DP group (its
CPU group), of each rank's "served by my FFN rank now". Where every rank is served, the
step goes to the FFN ranks. Otherwise a rank on a fresh link (no step sent on it yet)
fails the step at once without sending anything (`hold_step`): its link stays idle, its
heartbeat keeps it alive, and the ranks switch to their new links at the first step every
one of them begins served. A rank that stepped on its link before steps on, as without
this check: where its sibling lost its FFN rank, its own FFN rank's group lost a member,
and its step fails there at once (or its FFN rank already stopped, expert_group.py's
watch), so it learns that its FFN server is gone instead of idling on a dead link.

Every rank also computes, from the same all-reduce (each rank's state: away, served on a
fresh link, served on a link it stepped on), which ranks send the step, and the step's
control message carries that set (`senders`, protocol/control.py). So where one rank's
link alone is lost while its FFN server runs on (its FFN rank dropped it: a malformed
message, a hang, a partition of that link), its siblings step on and its FFN rank, whose
peers are not among the senders, takes part in the expert group's step with no rows
(expert_group.py) instead of leaving the others to wait until timeout_s breaks the group.

It costs one all-reduce of `data_parallel_size` int32 per step, only on attention servers
with data parallelism (lockstep, not async_dp) whose links fail alone, and whose FFN ranks
are expert groups (agreed once at start-up). Where a lost FFN rank stops the server
(attention TP, device graphs: `ffn_loss_fatal`) there is nothing to switch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from afd_core.log import get_logger

logger = get_logger(__name__)

# every rank's state in its own slot, summed: the vector of all ranks' states
Gather = Callable[[int], list[int]]

# a rank's state at the start of a step: no FFN rank serves it; served on a link no step
# went on yet; served on a link it stepped on before
AWAY, FRESH, STEPPED = 0, 1, 2


def gather_over(group, index: int, size: int) -> Gather:
    """Every rank's int over `group` (a torch ProcessGroup of `size` ranks, this one at
    `index`), by one all-reduce (SUM) of a vector holding each rank's in its own slot.
    The group's own method, not torch.distributed.all_reduce: the latter needs the group
    registered with a default group, which a test's stand-in for vLLM's has not."""

    def gather(value: int) -> list[int]:
        import torch
        import torch.distributed as dist

        t = torch.zeros(size, dtype=torch.int32)
        t[index] = value
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        group.allreduce([t], opts).wait()
        return t.tolist()

    return gather


class ServedTogether:
    """One attention rank's part of its server's per-step "every rank served?" (the ranks
    of its DP group, `ranks[i]` the attention rank at DP index i)."""

    def __init__(self, gather: Gather, ranks: Sequence[int], index: int):
        self._gather = gather
        self.ranks = list(ranks)
        self.index = index
        self.held = 0  # steps held while this rank was served (for tests and logs)
        self._holding = False

    def check(self, connector) -> None:
        """Before a step's control message: return where every rank begins this step
        served, or where this rank stepped on its link before; else fail the step at once
        (connector.hold_step). Either way the connector's next step carries which ranks
        send it (`step_senders`: every rank computes the same from the gather)."""
        steps = connector.link_steps()
        served = steps is not None
        states = self._gather(STEPPED if served and steps > 0 else FRESH if served else AWAY)
        waiting = [r for r, f in zip(self.ranks, states, strict=True) if f == AWAY]
        senders = [i for i, f in enumerate(states) if f == STEPPED or (f == FRESH and not waiting)]
        connector.step_senders = sum(1 << i for i in senders)
        if self.index in senders:
            if self._holding:
                self._holding = False
                logger.info(
                    "AFD attention rank %d: every rank of its server is served: steps go to "
                    "the FFN ranks again",
                    self.ranks[self.index],
                )
            return
        if served:
            self.held += 1
            if not self._holding:
                self._holding = True
                logger.warning(
                    "AFD attention rank %d: served on a new link, but holds its steps until "
                    "attention rank(s) %s of its server are served too (one expert group "
                    "serves them)",
                    self.ranks[self.index],
                    waiting,
                )
        others = [r for r in waiting if r != self.ranks[self.index]]
        connector.hold_step(
            f"attention rank(s) {others} of this server are not served by their FFN ranks yet"
            if others
            else "this rank is not served by its FFN rank"
        )


def for_attention_server(vllm_config, afd, connector) -> ServedTogether | None:
    """This attention worker's ServedTogether, or None where its server has nothing to
    switch together. Every DP rank of the server calls this at the same point of its
    start-up (the role's attach): the one all-reduce in it agrees whether any rank's FFN
    rank is in an expert group, so all ranks run the per-step check or none does."""
    pc = vllm_config.parallel_config
    if (
        pc.data_parallel_size == 1
        or afd.async_dp  # each DP rank steps on its own: no expert group serves them
        or connector.ffn_loss_fatal
        or not connector.survives_peer_loss
    ):
        return None
    from vllm.distributed.parallel_state import get_dp_group

    dp = get_dp_group()
    gather = gather_over(dp.cpu_group, dp.rank_in_group, dp.world_size)
    if not any(gather(int(connector.ffn_expert_group > 1))):
        return None
    # one attention rank per DP rank: with tensor parallelism a lost FFN rank is fatal
    ranks = [afd.start_rank + i for i in range(dp.world_size)]
    logger.info(
        "AFD attention rank %d: the FFN ranks of its server's ranks %s are expert groups: "
        "they are served together (one all-reduce over the DP group per step)",
        ranks[dp.rank_in_group],
        ranks,
    )
    return ServedTogether(gather, ranks, dp.rank_in_group)
