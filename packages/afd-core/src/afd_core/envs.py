"""Environment variables read by AFD. One place, so `afd doctor` and the docs can list them."""

from __future__ import annotations

import os

# "1" forces Python's default multiprocessing context to spawn (and redirects forkserver).
AFD_FORCE_SPAWN_MULTIPROCESSING = "AFD_FORCE_SPAWN_MULTIPROCESSING"
# Limits the afd_balanced routing strategy to the first n local experts of each EP rank.
AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK = "AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK"
# A path prefix: each AFD process writes its step timeline there (benchmarks, afd_core.trace).
AFD_STEP_TRACE = "AFD_STEP_TRACE"
# Set by AFD itself (to the role) in a process that parsed an AFD config at start-up; the
# processes vLLM starts after it (engine core, workers) inherit it. A deferred patch that
# fails in a process where it is set stops that process: a server never runs without it.
AFD_DEPLOYMENT_ROLE = "AFD_DEPLOYMENT_ROLE"
# The deployment secret every rank proves to the rendezvous (connectors/transports/gate.py):
# the value itself, or a file holding it. Never a command-line value (`ps` shows those).
AFD_DEPLOYMENT_SECRET = "AFD_DEPLOYMENT_SECRET"
AFD_DEPLOYMENT_SECRET_FILE = "AFD_DEPLOYMENT_SECRET_FILE"
# The local address (or network interface) AFD's gloo channels bind to and announce; by
# default the address this host reaches the rendezvous (afd.host) from
# (connectors/transports/channel_address.py).
AFD_CHANNEL_ADDRESS = "AFD_CHANNEL_ADDRESS"
AFD_CHANNEL_INTERFACE = "AFD_CHANNEL_INTERFACE"
# Where a server's AFD ranks write the numbers its /metrics shows (metrics.py); set by the
# server's first process unless the user sets it.
AFD_METRICS_DIR = "AFD_METRICS_DIR"
# Set by AFD itself in a server that spans hosts (vLLM's multi-node flags), for the
# processes it starts: its ranks of its role, "FIRST:COUNT". They share their metrics
# through the rendezvous store, so the head host's /metrics shows every host's (metrics.py).
# Set at config time: an async-DP engine's own config no longer says its server's size.
AFD_SERVER_RANKS = "AFD_SERVER_RANKS"
# Where generated tiny checkpoints are kept (afd_models.tiny: `afd demo`, `afd bench`, tests).
AFD_CACHE_DIR = "AFD_CACHE_DIR"
# vLLM's own variable that selects a MoE routing-simulation strategy.
VLLM_MOE_ROUTING_SIMULATION_STRATEGY = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"

ALL = {
    AFD_FORCE_SPAWN_MULTIPROCESSING: '"1" forces the spawn start method (opt-in)',
    AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK: "afd_balanced routing: experts per EP rank (0 = all)",
    VLLM_MOE_ROUTING_SIMULATION_STRATEGY: '"afd_balanced" selects AFD benchmark routing',
    AFD_STEP_TRACE: "path prefix: write step timelines <prefix>.<role><rank>.jsonl (benchmarks)",
    AFD_DEPLOYMENT_ROLE: "set by AFD at start-up (the role); a failing deferred patch then stops",
    AFD_DEPLOYMENT_SECRET: "the deployment secret (16+ bytes) the rendezvous requires",
    AFD_DEPLOYMENT_SECRET_FILE: "a file holding the deployment secret (instead of the value)",
    AFD_CHANNEL_ADDRESS: "local address AFD's channels bind to (default: the one routed to afd.host)",
    AFD_CHANNEL_INTERFACE: "network interface AFD's channels bind to (instead of an address)",
    AFD_METRICS_DIR: "where AFD ranks write what /metrics shows (default: a temporary folder)",
    AFD_SERVER_RANKS: "set by AFD at start-up in a server spanning hosts (its ranks, FIRST:COUNT)",
    AFD_CACHE_DIR: "where generated tiny checkpoints are kept (default: ~/.cache/afd)",
}


def force_spawn_requested() -> bool:
    return os.environ.get(AFD_FORCE_SPAWN_MULTIPROCESSING) == "1"


def balanced_routing_requested() -> bool:
    return os.environ.get(VLLM_MOE_ROUTING_SIMULATION_STRATEGY) == "afd_balanced"


def force_lb_topn_per_rank() -> int:
    """Parse AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK; unset or empty means 0 (all experts)."""
    raw = os.environ.get(AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"{AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK}={raw!r} is not an integer; "
            "allowed: 0 (all local experts) or a positive number of experts per EP rank"
        ) from None
    if value < 0:
        raise ValueError(
            f"{AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK}={value} is negative; "
            "allowed: 0 (all local experts) or a positive number of experts per EP rank"
        )
    return value


def mark_deployment(role: str) -> None:
    """This process starts an AFD server (its config was parsed): so do its children."""
    os.environ[AFD_DEPLOYMENT_ROLE] = role


def in_deployment() -> bool:
    """Whether this process, or the one that started it, parsed an AFD config."""
    return bool(os.environ.get(AFD_DEPLOYMENT_ROLE))


def mark_server_ranks(ranks: range) -> None:
    """This process starts a server spanning hosts with these ranks of its role: so do its
    children. Never unset here: a config made again later in a process (an async-DP engine's
    own, of data-parallel size 1) does not say its server's size."""
    os.environ[AFD_SERVER_RANKS] = f"{ranks.start}:{len(ranks)}"


def server_ranks() -> list[int] | None:
    """The ranks of this process's server if it spans hosts (mark_server_ranks), else None."""
    first, _, count = os.environ.get(AFD_SERVER_RANKS, "").partition(":")
    try:
        return list(range(int(first), int(first) + int(count)))
    except ValueError:
        return None
