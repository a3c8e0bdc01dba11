import pytest

pytestmark = pytest.mark.vllm


def test_registered_once_and_noop():
    import torch

    from afd_core import dbo

    dbo.register_dbo_yield_custom_op()
    assert dbo.register_dbo_yield_custom_op() is False  # a second registration is harmless
    assert dbo.is_registered()
    x = torch.arange(6.0)
    before = x.clone()
    torch.ops.vllm.manual_dbo_yield(x)
    assert torch.equal(x, before)
    schema = str(torch.ops.vllm.manual_dbo_yield.default._schema)
    assert "!) x" in schema  # declared as mutating: compile keeps it ordered


def test_kept_as_a_node_in_a_compiled_graph():
    import torch

    from afd_core import dbo

    dbo.register_dbo_yield_custom_op()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        y = x * 2
        torch.ops.vllm.manual_dbo_yield(y)
        return y + 1

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    out = compiled(torch.ones(4))
    assert torch.equal(out, torch.full((4,), 3.0))
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("manual_dbo_yield" in t for t in targets), targets
    mul = next(i for i, t in enumerate(targets) if "mul" in t)
    yld = next(i for i, t in enumerate(targets) if "manual_dbo_yield" in t)
    add = next(i for i, t in enumerate(targets) if "add" in t)
    assert mul < yld < add
