"""The MoE router on the attention side (`compute_gate_on_attention`), as real `vllm serve`
processes (DeepSeek-V3, fp32 greedy: sigmoid scores and noaux_tc routing with a non-zero
correction bias, which stays on the FFN side): the attention server computes each MoE
layer's router logits and sends them with the rows, the FFN server routes with them and
runs the experts only; the tokens are the colocated server's (test_afd_serve shows AFD with
the gate on the FFN side gives the colocated tokens too). This is also DeepSeek-V3's end-to-
end test.
"""

from __future__ import annotations

import pytest

from afd_plugin.launcher import local_deployment, running
from tests.e2e.conftest import BACKENDS_MORE, assert_same, reference, run_prompts, with_reference

pytestmark = pytest.mark.e2e

ARCH = "deepseek_v3"


def test_gate_on_attention_gives_the_colocated_tokens(checkpoints, log_dir):
    model = str(checkpoints(ARCH))
    d = local_deployment(
        model,
        log_dir,
        attention_backend=BACKENDS_MORE[ARCH],
        afd_extra={"compute_gate_on_attention": True},
        tag=f"{ARCH}-gate-on-attention-",
    )
    servers = with_reference(ARCH, model, log_dir, [d["ffn"], d["attention"]])
    with running(servers):
        ref = reference(ARCH, servers)
        assert_same(ref, run_prompts(d["attention"].url))
    ffn_log = d["ffn"].log_path.read_text(errors="replace")
    # the handshake carried the router width: 16 experts' logits per row
    assert "router_width=16" in ffn_log, d["ffn"].log_tail(60)
