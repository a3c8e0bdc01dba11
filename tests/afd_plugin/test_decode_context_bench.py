"""benchmarks/decode_context.py: its defaults cover the contexts and batches of issue 37
(capped by the KV cache it gives each server), and the servers it starts are given flags
vLLM parses, a DecodeBenchConnector config vLLM accepts, and no KV connector on the FFN
server (which AFD refuses)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import REPO


def _bench():
    path = REPO / "benchmarks" / "decode_context.py"
    spec = importlib.util.spec_from_file_location("decode_context", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_and_kv_cap():
    bench = _bench()
    a = bench.parse_args([])
    assert a.context == [1024, 4096, 8192] and max(a.batch) == 128
    plan = bench.points(a)
    # 128 x 8K tokens need ~8 GiB of fp32 KV per server: capped to the largest power of two
    assert (8192, 64, 128) in plan and (4096, 128, None) in plan
    assert all(bench.fits(b, c, a.tokens, a.kv_gib) for c, b, _ in plan)
    small = bench.points(bench.parse_args(["--kv-gib", "1", "--context", "8192"]))
    assert small == [(8192, 1, None), (8192, 8, 128)]  # 32 and 128 -> 8, run once
    with pytest.raises(SystemExit):
        bench.parse_args(["--tokens", "1"])


def _dict(value) -> dict:
    return value if isinstance(value, dict) else json.loads(value)


@pytest.mark.vllm
def test_server_flags_parse_and_connector_is_known(tmp_path: Path):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from afd_core.capabilities import kv_transfer_problem
    from afd_core.config import parse_afd_config

    bench = _bench()
    a = bench.parse_args([])
    parser = make_arg_parser(FlexibleArgumentParser(prog="api_server"))
    colo, ffn, att = bench.servers("/no/model", tmp_path, a, str(tmp_path / "trace"))
    for server in (colo, ffn, att):
        args = parser.parse_args(server.spec.command()[3:])
        assert args.max_model_len > max(a.context) + a.tokens
        assert _dict(args.hf_overrides)["max_position_embeddings"] >= args.max_model_len
        assert args.enable_prefix_caching is False
        role = server.spec.afd["role"] if server.spec.afd else None
        if role:
            parse_afd_config(server.spec.afd, device_type="cpu")
        if role == "ffn":
            assert args.kv_transfer_config is None
            continue
        kv = args.kv_transfer_config
        kv = kv if isinstance(kv, KVTransferConfig) else KVTransferConfig(**_dict(kv))
        assert kv.kv_connector in KVConnectorFactory._registry
        assert kv.get_from_extra_config("startup_fill", False) is True
        assert kv_transfer_problem(role or "colocated", True) is None
        assert server.spec.env["VLLM_CPU_KVCACHE_SPACE"] == str(a.kv_gib)
        assert server.spec.log_stats  # TPOT and the prefill check come from /metrics
