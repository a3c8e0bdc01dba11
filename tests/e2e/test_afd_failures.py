"""Bad configs and flags stop a server at start-up with the field named (the dead-FFN test
shares the deployment of test_afd_serve.py; config-level cases are in
tests/afd_core/test_config*.py)."""

from __future__ import annotations

import pytest

from afd_plugin.launcher import Server, ServerSpec, free_port

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "afd,args,needle",
    [
        ({"role": "attention", "prot": 1}, [], "unknown key 'prot'. Did you mean 'port'?"),
        (
            {"role": "attention", "num_attention_ranks": 2, "start_rank": 2},
            [],
            "start_rank=2 is out of range for an attention server",
        ),
        ({"role": "ffn"}, ["--enable-dbo"], "--enable-dbo on an FFN server"),
    ],
)
def test_bad_afd_config_exits_nonzero_naming_the_field(afd, args, needle, checkpoints, log_dir):
    model = str(checkpoints("qwen3_moe"))
    spec = ServerSpec(
        f"bad-{afd['role']}-{len(needle)}", model, free_port(), afd=afd, extra_args=args
    )
    server = Server(spec, log_dir)
    server.start()
    try:
        code = server.proc.wait(timeout=180)
    finally:
        server.stop()
    assert code != 0
    log = server.log_path.read_text(errors="replace")
    assert needle in log, server.log_tail()
