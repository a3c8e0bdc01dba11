"""Bad configs and flags stop a server at start-up with the field named (the dead-FFN test
shares the deployment of test_afd_serve.py; config-level cases are in
tests/afd_core/test_config*.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from afd_plugin.deploy.servers import Server, ServerSpec, free_port

pytestmark = pytest.mark.e2e


BAD_STARTS = {
    "unknown key": (
        {"role": "attention", "prot": 1},
        [],
        "unknown key 'prot'. Did you mean 'port'?",
    ),
    "start_rank out of range": (
        {"role": "attention", "num_attention_ranks": 2, "start_rank": 2},
        [],
        "start_rank=2 is out of range for an attention server",
    ),
    "DBO on an FFN server": ({"role": "ffn"}, ["--enable-dbo"], "--enable-dbo on an FFN server"),
    "no AFD wrapper": (
        {"role": "attention"},
        [],
        "'Qwen2MoeForCausalLM' has no AFD wrapper; AFD runs: DeepseekForCausalLM, "
        "DeepseekV2ForCausalLM, DeepseekV32ForCausalLM, DeepseekV3ForCausalLM, "
        "DeepseekV4ForCausalLM, GlmMoeDsaForCausalLM, Qwen3MoeForCausalLM (registered, not "
        "runnable here: Qwen3_5MoeForConditionalGeneration)",
    ),
}


def unwrapped_architecture(checkpoint: Path, into: Path) -> Path:
    """The checkpoint, labelled Qwen2-MoE: vLLM serves that natively, AFD has no wrapper."""
    shutil.copytree(checkpoint, into)
    config = json.loads((into / "config.json").read_text())
    config["architectures"] = ["Qwen2MoeForCausalLM"]
    (into / "config.json").write_text(json.dumps(config))
    return into


@pytest.fixture(scope="module")
def bad_starts(checkpoints, log_dir, tmp_path_factory):
    """Every bad start at once (each is one process importing vLLM, then exiting)."""
    model = checkpoints("qwen3_moe")
    other = unwrapped_architecture(model, tmp_path_factory.mktemp("qwen2") / "qwen2_moe")
    servers = {}
    for i, (case, (afd, args, _)) in enumerate(BAD_STARTS.items()):
        path = other if case == "no AFD wrapper" else model
        spec = ServerSpec(f"bad-{i}", str(path), free_port(), afd=afd, extra_args=args)
        servers[case] = Server(spec, log_dir)
    try:
        for server in servers.values():
            server.start()
        codes = {case: s.proc.wait(timeout=240) for case, s in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    return {case: (codes[case], servers[case]) for case in servers}


@pytest.mark.parametrize("case", list(BAD_STARTS))
def test_bad_afd_config_exits_nonzero_naming_the_field(case, bad_starts):
    code, server = bad_starts[case]
    assert code != 0
    log = server.log_path.read_text(errors="replace")
    assert BAD_STARTS[case][2] in log, server.log_tail()
