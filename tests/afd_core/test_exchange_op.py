"""The layer exchange as a custom op: what the attention side's FFN proxies call, opaque to
torch.compile (the step's Python never enters a traced graph) and run at every call."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


class RecordingConnector:
    """Answers every exchange with rows * 2 + layer and records what it was asked."""

    def __init__(self):
        self.calls = []

    def start_exchange(self, rows, layer, microbatch, logits=None, token_ids=None):
        self.calls.append((layer, microbatch, tuple(rows.shape), logits is not None))

        class Pending:
            def wait(self_inner):
                return rows * 2 + layer

        return Pending()


@pytest.fixture
def connector():
    from afd_core.runtime import install_connector

    conn = RecordingConnector()
    install_connector(conn)
    yield conn
    install_connector(None)


def test_the_op_runs_the_exchange_of_the_installed_connector(connector):
    import torch

    from afd_core.exchange import ffn_exchange_op

    op = ffn_exchange_op()
    assert op is torch.ops.afd.ffn_exchange
    h = torch.ones(3, 4)
    logits = torch.zeros(3, 8)
    assert torch.equal(op(h, 2, logits, None), h * 2 + 2)
    assert connector.calls == [(2, 0, (3, 4), True)]


def test_compiled_model_keeps_the_exchange_as_one_opaque_node(connector):
    """fullgraph=True fails on any graph break: the connector's Python stays out of the
    trace, and the exchange still runs at every call of the compiled model."""
    import torch

    from afd_core.exchange import ffn_exchange_op

    op = ffn_exchange_op()

    class TwoLayers(torch.nn.Module):
        def forward(self, x):
            for layer in range(2):
                x = x + op(torch.relu(x), layer, None, None)
            return x

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = TwoLayers()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(5, 4)
    want = model(x)
    connector.calls.clear()
    for _ in range(3):
        assert torch.equal(compiled(x), want)
    assert len(graphs) == 1
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("afd.ffn_exchange" in str(t) for t in ops) == 2
    assert [c[0] for c in connector.calls] == [0, 1] * 3  # it ran at every call


def test_fake_implementation_gives_the_output_shape_without_running():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from afd_core.exchange import ffn_exchange_op

    op = ffn_exchange_op()
    with FakeTensorMode():
        h = torch.empty(7, 16, dtype=torch.bfloat16)
        out = op(h, 0, torch.empty(7, 4), torch.empty(7, dtype=torch.int64))
    assert out.shape == (7, 16) and out.dtype == torch.bfloat16
