"""The MoE router on the attention side (`compute_gate_on_attention`) and attention tensor
parallel, as real `vllm serve` processes (DeepSeek-V3, fp32 greedy: sigmoid scores and
noaux_tc routing with a non-zero correction bias, which stays on the FFN side).

One deployment answers both: an attention server over tensor parallel 2 (two attention
ranks, each exchanging its share of the rows with the router logits of those rows) and one
FFN server that routes with the logits it is sent and runs the experts only. Its tokens are
those of a colocated server over tensor parallel 2: vLLM's CPU tensor parallel changes
DeepSeek-V3's greedy tokens against tensor parallel 1 (one prompt differs from its third
token on, colocated alike), so the reference runs at the same TP size. test_afd_serve shows
AFD with the gate on the FFN side gives the colocated tokens too. This is also
DeepSeek-V3's end-to-end test.
"""

from __future__ import annotations

import pytest

from afd_plugin.deploy.servers import local_deployment, running
from tests.e2e.conftest import BACKENDS_MORE, DEV_MODE, assert_same, rpc, run_prompts

pytestmark = pytest.mark.e2e

ARCH = "deepseek_v3"
TP = 2


def test_gate_on_attention_over_attention_tensor_parallel_gives_the_colocated_tokens(
    checkpoints, log_dir
):
    model = str(checkpoints(ARCH))
    d = local_deployment(
        model,
        log_dir,
        attention_tensor_parallel=TP,
        attention_backend=BACKENDS_MORE[ARCH],
        baseline=True,
        afd_extra={"compute_gate_on_attention": True},
        env=DEV_MODE,
        tag=f"{ARCH}-gate-on-attention-tp{TP}-",
    )
    colocated = d["colocated"]
    colocated.spec.tensor_parallel_size = TP  # the same TP numerics as the attention side
    colocated.spec.env = {**colocated.spec.env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    colocated.spec.env.pop("OMP_NUM_THREADS", None)
    with running(list(d.values())):
        assert_same(run_prompts(colocated.url), run_prompts(d["attention"].url))
        attention = rpc(d["attention"].url, "afd_step_stats")
        (ffn,) = rpc(d["ffn"].url, "afd_step_stats")
    ffn_log = d["ffn"].log_path.read_text(errors="replace")
    # the handshake carried the router width: 16 experts' logits per row
    assert "router_width=16" in ffn_log, d["ffn"].log_tail(60)
    # every TP rank forwarded every token but exchanged only its share: the FFN rank
    # computed each row once (decode steps of one token: TP rank 1's share is empty)
    assert [a["rank"] for a in attention] == [0, 1], attention
    tokens = attention[0]["tokens"]
    assert attention[1]["tokens"] == tokens > 0, attention
    assert sum(a["rows"] for a in attention) == ffn["rows"] == tokens, (attention, ffn)
    assert 0 < attention[1]["rows"] < attention[0]["rows"], attention
