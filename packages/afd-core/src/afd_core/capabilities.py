"""What AFD runs, per platform: the one table that the servers' start-up check
(patches/config_validation.py, afd-npu's ascend_config), the planner's candidate search,
`afd plan --write-spec` and the deployment-spec check all read. Pure Python.

`PLATFORMS` holds it: graph modes, micro-batches per step with and without graphs, FFN
tensor parallelism, FFN expert groups and expert parallelism, A:F; `table_markdown()`
renders it for docs/deploy.md ("What AFD runs, per platform"). Each refusal carries its
reason (`why`), so every caller names the same cause.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_MICROBATCHES = (
    4  # the control message's field (connectors/protocol/control.py) holds up to this
)
# with graphs on CUDA, vLLM's UBatchWrapper replays steps split in this many (vllm_ubatch.py)
MICROBATCHES_WITH_GRAPHS = 2
EAGER = "NONE"


class CapabilityError(ValueError):
    """A shape or setting the platform's AFD path does not run; names it and what is allowed."""


@dataclass(frozen=True)
class Capabilities:
    platform: str
    name: str  # how messages call it
    graphs_name: str  # what vLLM's cudagraph modes capture there
    graph_modes: tuple[str, ...]  # vLLM cudagraph modes AFD steps run with ("NONE": eager)
    default_graph_mode: str  # what a deployment spec runs unless a server's args choose
    max_microbatches: int  # eager
    max_microbatches_with_graphs: int  # 0: graphs do not run here
    adaptive_microbatches: bool  # `num_microbatches: "auto"`, eager only
    ffn_tensor_parallel: bool
    ffn_expert_group: bool
    expert_parallel: bool  # vLLM's --enable-expert-parallel on an FFN expert group
    why: dict[str, str] = field(default_factory=dict)  # the reason for each refusal

    def microbatch_limit(self, graph_mode: str) -> int:
        return self.max_microbatches if graph_mode == EAGER else self.max_microbatches_with_graphs


PLATFORMS: dict[str, Capabilities] = {
    "cpu": Capabilities(
        platform="cpu",
        name="CPU",
        graphs_name="CUDA graphs",
        graph_modes=(EAGER,),
        default_graph_mode=EAGER,
        max_microbatches=MAX_MICROBATCHES,
        max_microbatches_with_graphs=0,
        adaptive_microbatches=True,
        ffn_tensor_parallel=True,
        ffn_expert_group=True,
        expert_parallel=False,
        why={
            "graphs": "AFD on CPU runs the model eagerly (the layer exchange is Python code "
            "that torch.compile must not trace)",
            "expert_parallel": "vLLM 0.32's CPU fused-MoE kernel crashes with an expert map "
            "(segfault in cpu_fused_moe.cpp, colocated too); leave it off and vLLM shards "
            "every expert over the data-parallel FFN ranks instead",
        },
    ),
    "cuda": Capabilities(
        platform="cuda",
        name="CUDA",
        graphs_name="CUDA graphs",
        graph_modes=(EAGER, "FULL_DECODE_ONLY"),
        default_graph_mode="FULL_DECODE_ONLY",
        max_microbatches=MAX_MICROBATCHES,
        max_microbatches_with_graphs=MICROBATCHES_WITH_GRAPHS,
        adaptive_microbatches=True,
        ffn_tensor_parallel=False,
        ffn_expert_group=True,
        expert_parallel=True,
        why={
            "graphs_microbatches": "with graphs vLLM's UBatchWrapper splits steps in "
            f"{MICROBATCHES_WITH_GRAPHS}",
            "graphs_adaptive": "with graphs vLLM's UBatchWrapper splits every step it "
            "captured alike",
            "ffn_tensor_parallel": "its TP rank 0 forwards the rows to the others in CPU buffers",
        },
    ),
    "npu": Capabilities(
        platform="npu",
        name="Ascend",
        graphs_name="ACL graphs",
        graph_modes=(EAGER,),
        default_graph_mode=EAGER,
        max_microbatches=1,
        max_microbatches_with_graphs=0,
        adaptive_microbatches=False,
        ffn_tensor_parallel=False,
        ffn_expert_group=False,
        expert_parallel=False,
        why={
            "graphs": "AFD's step wrapper does not see vLLM-Ascend's graph wrapper, and with "
            "FULL graphs vLLM-Ascend still compiles the model, which must not trace the "
            "layer exchange",
            "microbatches": "vLLM-Ascend builds one attention metadata per step (one builder "
            "per attention group, no micro-batch slices)",
            "ffn_tensor_parallel": "its TP rank 0 forwards the rows to the others in CPU buffers",
            "ffn_expert_group": "vLLM-Ascend's MoE communication (MC2, all-gather) has not "
            "been wired to AFD's expert group",
            "expert_parallel": "an FFN server is one FFN rank on Ascend (no expert group)",
        },
    ),
}


def capabilities(platform: str) -> Capabilities:
    try:
        return PLATFORMS[platform]
    except KeyError:
        raise CapabilityError(
            f"platform={platform!r} is unknown; allowed: {', '.join(PLATFORMS)}"
        ) from None


GRAPH_MODE_FLAGS = {
    EAGER: "none (--enforce-eager)",
    "FULL_DECODE_ONLY": "FULL_DECODE_ONLY (--compilation-config "
    '\'{"cudagraph_mode": "FULL_DECODE_ONLY"}\')',
}


def graph_mode_problem(platform: str, graph_mode: str) -> str | None:
    caps = capabilities(platform)
    if graph_mode in caps.graph_modes:
        return None
    why = f": {caps.why['graphs']}" if "graphs" in caps.why else ""
    return (
        f"AFD on {caps.name}: cudagraph_mode={graph_mode} ({caps.graphs_name}) is not "
        f"supported yet{why}; allowed: "
        + " or ".join(GRAPH_MODE_FLAGS[m] for m in reversed(caps.graph_modes))
    )


def microbatch_problem(
    platform: str, microbatches: int, graph_mode: str = EAGER, adaptive: bool = False
) -> str | None:
    """Why `microbatches` per step (or "auto") cannot run with `graph_mode`, else None."""
    caps = capabilities(platform)
    problem = graph_mode_problem(platform, graph_mode)
    if problem:
        return problem
    if adaptive:
        if not caps.adaptive_microbatches:
            return (
                f"AFD on {caps.name}: afd.num_microbatches='auto' is not supported "
                f"({caps.why['microbatches']}); allowed: afd.num_microbatches 1"
            )
        if graph_mode != EAGER:
            return (
                f"AFD on {caps.name}: afd.num_microbatches='auto' with cudagraph_mode="
                f"{graph_mode}: {caps.why['graphs_adaptive']}; allowed: 'auto' with "
                f"--enforce-eager, or afd.num_microbatches={caps.max_microbatches_with_graphs} "
                "with graphs"
            )
        return None
    limit = caps.microbatch_limit(graph_mode)
    if 1 <= microbatches <= limit:
        return None
    if caps.max_microbatches == 1:
        return (
            f"AFD on {caps.name}: {microbatches} micro-batches per step (DBO) is not "
            f"supported: {caps.why['microbatches']}; allowed: afd.num_microbatches 1, "
            "without --enable-dbo / --ubatch-size"
        )
    if graph_mode != EAGER:
        return (
            f"AFD on {caps.name}: {microbatches} micro-batches per step (DBO) with "
            f"cudagraph_mode={graph_mode}: {caps.why['graphs_microbatches']}; allowed: "
            f"afd.num_microbatches={caps.max_microbatches_with_graphs} with graphs, or up to "
            f"{caps.max_microbatches} with --enforce-eager"
        )
    return (
        f"AFD on {caps.name}: {microbatches} micro-batches per step; allowed "
        f"1..{caps.max_microbatches}"
    )


def ffn_server_problem(
    platform: str, tensor_parallel: int, data_parallel: int, expert_parallel: bool = False
) -> str | None:
    """Why an FFN server of this shape cannot run on `platform`, else None."""
    caps = capabilities(platform)
    if tensor_parallel > 1 and not caps.ffn_tensor_parallel:
        return (
            f"AFD on {caps.name}: an FFN server with --tensor-parallel-size={tensor_parallel} "
            f"is not supported yet ({caps.why['ffn_tensor_parallel']}); allowed: "
            "--tensor-parallel-size 1"
            + (
                ", with --data-parallel-size N for N FFN ranks as one expert group"
                if caps.ffn_expert_group
                else " (one device per FFN rank)"
            )
        )
    if data_parallel > 1 and not caps.ffn_expert_group:
        return (
            f"AFD on {caps.name}: an FFN server with --data-parallel-size={data_parallel} "
            f"(FFN ranks as one expert group) is not supported yet: "
            f"{caps.why['ffn_expert_group']}; allowed: one FFN rank per FFN server (start "
            "more FFN servers, each with its start_rank)"
        )
    if data_parallel > 1 and tensor_parallel > 1:
        return (
            f"AFD: an FFN server with --data-parallel-size={data_parallel} and "
            f"--tensor-parallel-size={tensor_parallel} is not supported; allowed: "
            "--tensor-parallel-size 1 with data parallelism (vLLM then shards the experts "
            "over the data-parallel ranks), or one FFN rank per server over tensor parallel"
        )
    if expert_parallel and data_parallel > 1 and not caps.expert_parallel:
        return (
            f"AFD: --enable-expert-parallel on an FFN server is not supported on "
            f"{caps.name}: {caps.why['expert_parallel']}"
        )
    return None


@dataclass(frozen=True)
class FFNLayout:
    """How F FFN devices serve A attention ranks: `servers` FFN servers, each of
    `ranks_per_server` data-parallel FFN ranks (one expert group when > 1) of
    `tensor_parallel` devices each."""

    servers: int
    ranks_per_server: int
    tensor_parallel: int
    expert_parallel: bool = False  # the group holds each expert on one rank (vLLM's EP)

    @property
    def ranks(self) -> int:
        return self.servers * self.ranks_per_server

    @property
    def devices(self) -> int:
        return self.ranks * self.tensor_parallel

    @property
    def devices_per_copy(self) -> int:
        """Devices one copy of the experts is spread over (the others are replicas)."""
        return self.ranks_per_server * self.tensor_parallel


def ffn_layout(
    attention_ranks: int, ffn_devices: int, platform: str, attention_heads: int | None = None
) -> FFNLayout:
    """The FFN servers that serve A attention ranks with F FFN devices on `platform`, or
    CapabilityError why none can. F <= A: one FFN server of F data-parallel ranks (an
    expert group; with expert parallelism where the platform runs it), or on a platform
    without expert groups F servers of one rank each. F > A: fewer FFN ranks of several
    tensor-parallel devices each (the most ranks, at most A, that divide F, with a TP size
    that divides the model's attention heads, which vLLM requires of every server), where
    the platform runs FFN tensor parallelism."""
    a, f = attention_ranks, ffn_devices
    caps = capabilities(platform)
    if a < 1 or f < 1:
        raise CapabilityError(f"num_attention_ranks={a}, num_ffn_ranks={f}: both must be >= 1")
    if f <= a:
        if caps.ffn_expert_group:
            return FFNLayout(1, f, 1, expert_parallel=caps.expert_parallel and f > 1)
        return FFNLayout(f, 1, 1)
    if not caps.ffn_tensor_parallel:
        raise CapabilityError(
            f"{a}A{f}F needs more FFN devices than attention ranks, that is FFN tensor "
            f"parallelism, which AFD rejects on {platform} "
            f"({caps.why['ffn_tensor_parallel']}); allowed: A >= F"
        )
    for ranks in range(min(a, f), 0, -1):
        tp = f // ranks
        if f % ranks or (attention_heads and attention_heads % tp):
            continue
        return FFNLayout(ranks, 1, tp)
    raise CapabilityError(
        f"{a}A{f}F: no FFN tensor-parallel size divides both {f} devices and the model's "
        f"{attention_heads} attention heads; allowed: A >= F, or an F that such a size divides"
    )


def kv_transfer_problem(role: str, kv_transfer: bool, kv_offloading: bool = False) -> str | None:
    """Why a server of `role` cannot take vLLM's KV transfer (--kv-transfer-config) or KV
    offloading (--kv-offloading-size, which vLLM turns into a KV connector), else None: an
    FFN server holds no KV cache. An attention server may be a KV consumer (the decode
    stage of a prefill/decode deployment, docs/pd.md) or producer."""
    if role != "ffn" or not (kv_transfer or kv_offloading):
        return None
    flag = "--kv-transfer-config" if kv_transfer else "--kv-offloading-size"
    return (
        f"AFD: {flag} on an FFN server: an FFN server holds no KV cache (its engine has no "
        "attention layers), so it has none to load, save or offload; allowed: give "
        f"{flag} to the attention servers (kv_role kv_consumer or kv_both for the decode "
        "stage of a prefill/decode deployment, docs/pd.md) and remove it from the FFN server"
    )


def async_dp_problem(async_dp: bool, ffn_expert_group: bool) -> str | None:
    if async_dp and ffn_expert_group:
        return (
            "afd.async_dp with an FFN expert group (an FFN server with data_parallel_size > 1) "
            "is not supported: the group's members step together, so their attention peers "
            "must too; allowed: async_dp false, or FFN servers of one rank each"
        )
    return None


def table_markdown() -> str:
    """The table above as docs/deploy.md shows it (a test checks they agree)."""

    def yes(v: bool) -> str:
        return "yes" if v else "no"

    rows = [
        (
            "graph modes AFD steps run with",
            lambda c: ", ".join("none (eager)" if m == EAGER else m for m in c.graph_modes),
        ),
        (
            "what a deployment spec runs",
            lambda c: "eager" if c.default_graph_mode == EAGER else c.default_graph_mode,
        ),
        (
            "micro-batches per step, eager",
            lambda c: f"1..{c.max_microbatches}" + (", auto" if c.adaptive_microbatches else ""),
        ),
        (
            "micro-batches per step, with graphs",
            lambda c: (
                f"1..{c.max_microbatches_with_graphs}" if c.max_microbatches_with_graphs else "-"
            ),
        ),
        ("FFN tensor parallelism (F > A)", lambda c: yes(c.ffn_tensor_parallel)),
        ("FFN expert group (FFN server DP > 1)", lambda c: yes(c.ffn_expert_group)),
        ("expert parallelism in the group", lambda c: yes(c.expert_parallel)),
        ("A:F", lambda c: "A >= F, or F > A by FFN TP" if c.ffn_tensor_parallel else "A >= F"),
        ("async DP with an FFN expert group", lambda c: "no"),
    ]
    caps = list(PLATFORMS.values())
    lines = [
        "| rule | " + " | ".join(f"{c.name} (`{c.platform}`)" for c in caps) + " |",
        "| --- |" + " --- |" * len(caps),
    ]
    lines += [f"| {name} | " + " | ".join(cell(c) for c in caps) + " |" for name, cell in rows]
    return "\n".join(lines) + "\n"
