"""The ping-pong schedule of one AFD step: m micro-batches through L layers.

Four resources, each serving in (layer, micro-batch) order as AFD's step engine does (the
attention side's baton threads, the FFN side's pipelined server): the attention device,
the A->F link, the FFN devices, the F->A link. A micro-batch's layer l+1 on attention waits
for its own layer-l result. `step_time` is the resulting makespan (exact for these
deterministic times); `megascale_step_time` is MegaScale-Infer's closed form
(arXiv 2504.02263): (Ta + Te + 2Tc) + Tf (m L - 1), Tf = max(Ta, Te), which equals it when
the pipeline has no bubbles: m Tf >= Ta + Te + 2 Tc (i.e. m >= 2 (1 + Tc/Tf) when Ta = Te).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def step_time(
    attention: Sequence[float],
    ffn: Sequence[float],
    microbatches: int,
    latency: float = 0.0,
    occupancy: float = 0.0,
) -> float:
    """attention[l], ffn[l]: one micro-batch's time on layer l; a transfer takes `latency`
    plus `occupancy` of its link (one direction, per micro-batch)."""
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1")
    if len(attention) != len(ffn):
        raise ValueError(f"{len(attention)} attention layer times for {len(ffn)} FFN ones")
    a_free = f_free = up_free = down_free = 0.0
    back = [0.0] * microbatches  # when micro-batch i's input for the next layer is ready
    for ta, te in zip(attention, ffn, strict=True):
        for i in range(microbatches):
            a_end = max(a_free, back[i]) + ta
            a_free = a_end
            up_free = max(up_free, a_end) + occupancy
            f_end = max(f_free, up_free + latency) + te
            f_free = f_end
            down_free = max(down_free, f_end) + occupancy
            back[i] = down_free + latency
    return max(back)


def megascale_step_time(ta: float, te: float, tc: float, microbatches: int, layers: int) -> float:
    return (ta + te + 2 * tc) + max(ta, te) * (microbatches * layers - 1)


def megascale_min_microbatches(tc: float, tf: float) -> int:
    """The fewest micro-batches that keep the slower side busy: m >= 2 (1 + Tc/Tf)."""
    return math.ceil(2 * (1 + tc / tf))
