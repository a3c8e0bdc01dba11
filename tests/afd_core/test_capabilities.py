"""The table of what AFD runs per platform (afd_core.capabilities): its rules, the layouts
it gives, and docs/deploy.md showing it. Pure Python (the core lane runs it); the servers'
start-up check reading it is tested in test_config_validation.py, test_cuda_path.py and
tests/afd_npu, the planner and the spec check in tests/afd_plugin/test_plan_to_servers.py."""

from __future__ import annotations

import pytest

from afd_core.capabilities import (
    CapabilityError,
    FFNLayout,
    ffn_layout,
    ffn_server_problem,
    graph_mode_problem,
    microbatch_problem,
    table_markdown,
)
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("platform", "m", "mode", "adaptive", "problem"),
    [
        ("cpu", 4, "NONE", False, None),
        ("cpu", 5, "NONE", False, "allowed 1..4"),
        ("cpu", 1, "FULL_DECODE_ONLY", False, "CPU: cudagraph_mode=FULL_DECODE_ONLY"),
        ("cuda", 2, "FULL_DECODE_ONLY", False, None),
        ("cuda", 3, "FULL_DECODE_ONLY", False, "splits steps in 2"),
        ("cuda", 4, "NONE", False, None),
        ("cuda", 4, "NONE", True, None),
        ("cuda", 4, "FULL_DECODE_ONLY", True, "'auto' with --enforce-eager"),
        ("cuda", 1, "FULL_AND_PIECEWISE", False, "FULL_AND_PIECEWISE (CUDA graphs)"),
        ("npu", 1, "NONE", False, None),
        ("npu", 2, "NONE", False, "one attention metadata per step"),
        ("npu", 1, "FULL_DECODE_ONLY", False, "(ACL graphs) is not supported yet"),
        ("npu", 4, "NONE", True, "'auto' is not supported"),
    ],
)
def test_microbatches_and_graphs_per_platform(platform, m, mode, adaptive, problem):
    got = microbatch_problem(platform, m, mode, adaptive)
    assert (got is None) == (problem is None), got
    if problem:
        assert problem in got


def test_ffn_servers_per_platform():
    assert ffn_server_problem("cpu", 4, 1) is None
    assert ffn_server_problem("cpu", 1, 4) is None
    assert "segfault" in ffn_server_problem("cpu", 1, 4, expert_parallel=True)
    assert "--tensor-parallel-size=2 is not supported yet" in ffn_server_problem("cuda", 2, 1)
    assert ffn_server_problem("cuda", 1, 8, expert_parallel=True) is None
    assert "expert group" in ffn_server_problem("npu", 1, 2)
    assert "--data-parallel-size=2 and --tensor-parallel-size=2" in ffn_server_problem("cpu", 2, 2)


def test_layouts_follow_the_platform():
    assert ffn_layout(48, 24, "cuda") == FFNLayout(1, 24, 1, expert_parallel=True)
    assert ffn_layout(48, 24, "cpu") == FFNLayout(1, 24, 1)
    assert ffn_layout(48, 24, "npu") == FFNLayout(24, 1, 1)
    assert ffn_layout(3, 1, "cuda") == FFNLayout(1, 1, 1)  # one rank: no group, no EP
    # F > A: FFN tensor parallelism, CPU only, a TP size dividing the attention heads
    assert ffn_layout(2, 6, "cpu") == FFNLayout(2, 1, 3)
    assert ffn_layout(2, 8, "cpu", attention_heads=32) == FFNLayout(2, 1, 4)
    with pytest.raises(CapabilityError, match="no FFN tensor-parallel size divides"):
        ffn_layout(2, 6, "cpu", attention_heads=32)  # TP 3 or 6: neither divides 32 heads
    with pytest.raises(CapabilityError, match="which AFD rejects on cuda"):
        ffn_layout(2, 4, "cuda")
    with pytest.raises(CapabilityError, match="unknown; allowed: cpu, cuda, npu"):
        ffn_layout(1, 1, "tpu")


def test_graph_modes_name_what_is_allowed():
    assert graph_mode_problem("cuda", "FULL_DECODE_ONLY") is None
    assert "allowed: FULL_DECODE_ONLY" in graph_mode_problem("cuda", "PIECEWISE")
    assert "none (--enforce-eager)" in graph_mode_problem("cpu", "PIECEWISE")


def test_docs_show_the_table():
    text = (REPO / "docs" / "deploy.md").read_text()
    start = "<!-- generated: afd_core.capabilities.table_markdown -->\n"
    shown = text[
        text.index(start) + len(start) : text.index("<!-- end generated -->", text.index(start))
    ]
    assert shown == table_markdown(), (
        "paste afd_core.capabilities.table_markdown() into docs/deploy.md"
    )
