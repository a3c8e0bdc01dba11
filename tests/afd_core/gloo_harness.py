"""Real processes talking through the gloo connector: builders and a deployment runner.

Process targets must be importable by spawned children, so they live in test modules or
here; each puts (key, result) on the queue, a result string starting with "ERROR" failing
the test with the child's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from pathlib import Path

from afd_core.net import free_port  # noqa: F401 (the tests take it from here)

HIDDEN = 8
LAYERS = 3


def checked_step(conn, rank: int, step: int, layers: int = LAYERS, after_first_layer=None) -> bool:
    """One attention step of 2 + rank rows through an FFN rank computing h * 2 + layer;
    True if the FFN output is right. `after_first_layer()`: called once the first layer's
    exchange is done (a fault in the middle of a step)."""
    import torch

    conn.begin_step((2 + rank,))
    h = torch.full((2 + rank, HIDDEN), float(step))
    want = h.clone()
    for layer in range(layers):
        h = conn.start_exchange(h, layer, 0).wait()
        want = want * 2 + layer
        if layer == 0 and after_first_layer is not None:
            after_first_layer()
    conn.end_step()
    return torch.equal(h, want)


def wait_for(path: Path, wait_s: float) -> None:
    """Until another process of the test made `path` (at most wait_s)."""
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never came")
        time.sleep(0.05)


def make(
    role,
    rank,
    a,
    f,
    port,
    timeout=20.0,
    hidden=HIDDEN,
    dtype="float32",
    router_width=0,
    token_ids=False,
    layers=LAYERS,
    connect_timeout=30.0,
    start_rank=0,
    host="127.0.0.1",
):
    from afd_core.config import parse_afd_config
    from afd_core.connectors.base import WireSpec
    from afd_core.connectors.factory import build_connector

    # AFD_TEST_CONNECTOR=nccl / hccl: the device connectors over CPU stand-ins (tests/
    # afd_core/nccl_standin.py), so a protocol test runs unchanged over an issue-ordered channel
    device_connector = os.environ.get("AFD_TEST_CONNECTOR")
    device_type = {"nccl": "cuda", "hccl": "npu"}.get(device_connector, "cpu")
    # start-up's bound (the wait for peers that are still loading, start-up steps): the
    # connect timeout here, where every process starts at once, unless a test sets it
    extra = {
        "timeout_s": timeout,
        "connect_timeout_s": connect_timeout,
        "startup_timeout_s": float(os.environ.get("AFD_TEST_STARTUP_TIMEOUT_S", connect_timeout)),
    }
    if os.environ.get("AFD_TEST_LIVENESS_S"):
        extra["liveness_timeout_s"] = float(os.environ["AFD_TEST_LIVENESS_S"])
    if os.environ.get("AFD_TEST_RECOVERY_GRACE_S"):
        extra["recovery_grace_s"] = float(os.environ["AFD_TEST_RECOVERY_GRACE_S"])
    cfg = parse_afd_config(
        {
            "connector": device_connector if device_type != "cpu" else "gloo",
            "role": role,
            "host": host,
            "port": port,
            "num_attention_ranks": a,
            "num_ffn_ranks": f,
            "start_rank": start_rank,
            "connector_extra_config": extra,
        },
        device_type=device_type,
    )
    wire = WireSpec(hidden, dtype, layers, 64, router_width=router_width, token_ids=token_ids)
    if device_type != "cpu":
        from tests.afd_core import nccl_standin

        standin = getattr(nccl_standin, f"{device_connector}_standin_connector")
        return standin(cfg, rank, wire)
    return build_connector(cfg, rank, wire)


def _context():
    """A fork server that imported torch once: each child forks from it in milliseconds
    instead of importing torch (seconds each); nothing else runs in it, so the children
    start as clean as spawned ones (no threads, no process group)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _child(env: dict, module: str, name: str, args: tuple) -> None:
    """In the child: the test process's environment as it is now (the fork server's is
    the one it started with), then the target's module imported under it."""
    import importlib

    os.environ.clear()
    os.environ.update(env)
    getattr(importlib.import_module(module), name)(*args)


def run_processes(
    targets_and_args: list[tuple], timeout: float = 120, expect: int | None = None
) -> dict:
    """Start target(*args, queue) for each entry; collect {key: result} from the queue
    (`expect` results: fewer than the processes when some are meant to die)."""
    ctx = _context()
    q = ctx.Queue()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(env, t.__module__, t.__qualname__, (*args, q)))
        for t, *args in targets_and_args
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(len(procs) if expect is None else expect):
            try:
                key, out = q.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(
                    f"no result for {timeout:.0f} s; results so far: {sorted(results)}; "
                    + ", ".join(
                        f"{t.__qualname__}{tuple(args)[:2]}: "
                        + ("running" if p.is_alive() else f"exit code {p.exitcode}")
                        for p, (t, *args) in zip(procs, targets_and_args, strict=True)
                    )
                ) from None
            results[key] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def assert_no_errors(results: dict) -> None:
    errors = [str(v) for v in results.values() if isinstance(v, str) and v.startswith("ERROR")]
    assert not errors, "\n".join(errors)
