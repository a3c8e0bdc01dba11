"""On an Ascend machine (torch_npu, two NPUs): the HCCL connector over real ProcessGroupHCCL
communicators, one process per NPU, with NPU tensors. Marked npu: ./scripts/test deselects
it, and it skips without two NPUs (no NPU exists where AFD is developed: never run yet)."""

from __future__ import annotations

import traceback

import pytest

from tests.afd_core.gloo_harness import HIDDEN, assert_no_errors, free_port, run_processes

pytestmark = pytest.mark.npu

STEPS = [(5,), (2, 3), (64,)]
LAYERS = 3


def _connector(role: str, port: int, npu: int):
    import torch
    import torch_npu  # noqa: F401 - registers torch.npu

    from afd_core.config import parse_afd_config
    from afd_core.connectors.base import WireSpec
    from afd_core.connectors.factory import build_connector

    torch.npu.set_device(npu)
    cfg = parse_afd_config(
        {"role": role, "port": port, "num_attention_ranks": 1, "num_ffn_ranks": 1},
        device_type="npu",
    )
    return build_connector(cfg, 0, WireSpec(HIDDEN, "float32", LAYERS, 64))


def ffn_on_npu(port, q):
    try:
        from afd_core.step.ffn import FFNStepServer

        conn = _connector("ffn", port, 0)
        conn.init()
        server = FFNStepServer(conn, list(range(LAYERS)), lambda layer, h, _l, _i: h * 2 + layer)
        import threading

        server.serve(threading.Event())
        conn.close()
        q.put(("ffn", server.steps))
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def attention_on_npu(port, q):
    try:
        import torch

        conn = _connector("attention", port, 1)
        conn.init()
        for rows in STEPS:
            conn.begin_step(rows)
            for layer in range(LAYERS):
                for mb, n in enumerate(rows):
                    h = torch.full((n, HIDDEN), float(layer + 1), device="npu:1")
                    out = conn.start_exchange(h, layer, mb).wait()
                    torch.npu.synchronize()
                    assert torch.equal(out.cpu(), (h * 2 + layer).cpu())
            conn.end_step()
        conn.close()
        q.put(("attention", "ok"))
    except Exception:
        q.put(("attention", "ERROR " + traceback.format_exc()))


def test_steps_over_real_hccl():
    pytest.importorskip("torch_npu")
    import torch

    if not torch.npu.is_available() or torch.npu.device_count() < 2:
        pytest.skip("needs two Ascend NPUs")
    port = free_port()
    out = run_processes([(ffn_on_npu, port), (attention_on_npu, port)])
    assert_no_errors(out)
    assert out == {"ffn": len(STEPS), "attention": "ok"}
