"""One truth from plan to servers: every shape `afd plan` lists, for every preset model on
every preset hardware at two TPOT targets, written as `afd plan --write-spec` writes it,
passes the spec check, and every server of that spec passes its own start-up check: its
`vllm serve` arguments as `commands()` renders them, read by vLLM's own argument parser,
a real vLLM config built from them on CPU (the tiny checkpoint standing in for the model,
the parallel sizes and flags set as parsed), then AFD's start-up check for the spec's
platform (`prepare_afd_config`, plus afd-npu's `validate_npu` on Ascend)."""

from __future__ import annotations

import json
import tomllib

import pytest

from afd_core.planner.hardware import PRESETS as HW_PRESETS
from afd_core.planner.hardware import load_hardware
from afd_core.planner.model_shape import PRESETS
from afd_core.planner.search import plan
from afd_plugin.deploy.from_plan import parse_host, spec_toml
from afd_plugin.deploy.spec import check_spec, commands

pytestmark = pytest.mark.vllm

# 128 devices: GPU/NPU nodes of 8; CPU hosts of 64 cores (an FFN TP server stays on one)
HOSTS = {
    "gpu": [parse_host(f"h{i}=10.0.{i}.1:8") for i in range(16)],
    "cpu": [parse_host(f"h{i}=10.0.{i}.1:64") for i in range(2)],
}
HARDWARE = [*sorted(HW_PRESETS), "cpu"]
# the CPU preset is a measured 2-core machine: its targets are seconds
TPOT_MS = {"cpu": (1000, 3000)}


@pytest.fixture(scope="module")
def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.fixture(scope="module")
def startup_check(vllm_parser, checkpoints):
    """check(platform, argv): the server's start-up check on its rendered argv; results are
    shared between servers whose checks read the same values."""
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from afd_core.patches.config_validation import prepare_afd_config

    model = str(checkpoints("qwen3_moe"))
    seen: dict = {}

    def check(platform: str, argv: list[str]) -> None:
        args = vllm_parser.parse_args(argv[2:])  # after "vllm serve"
        mode = "NONE" if args.enforce_eager else args.compilation_config.cudagraph_mode.name
        afd = (
            json.loads(args.additional_config["afd"])
            if isinstance(args.additional_config["afd"], str)
            else args.additional_config["afd"]
        )
        parallel = {
            "tensor_parallel_size": args.tensor_parallel_size,
            "data_parallel_size": args.data_parallel_size,
            "enable_expert_parallel": args.enable_expert_parallel,
            "enable_dbo": args.enable_dbo,
            "ubatch_size": args.ubatch_size,
            "dbo_decode_token_threshold": args.dbo_decode_token_threshold,
            "dbo_prefill_token_threshold": args.dbo_prefill_token_threshold,
        }
        key = (platform, mode, json.dumps(afd, sort_keys=True), tuple(parallel.items()))
        if key in seen:
            return
        cfg = EngineArgs(model=model, max_model_len=128, enforce_eager=True).create_engine_config()
        cfg.additional_config = {"afd": afd}
        cfg.compilation_config.cudagraph_mode = getattr(CUDAGraphMode, mode)
        for name, value in parallel.items():
            setattr(cfg.parallel_config, name, value)
        prepared = prepare_afd_config(platform, cfg)
        if platform == "npu":
            from afd_npu.patches.ascend_config import validate_npu

            validate_npu(*prepared, cfg)
        seen[key] = True

    check.seen = seen
    return check


@pytest.mark.parametrize("hardware", HARDWARE)
def test_every_listed_shape_starts_on_every_server_of_the_spec_it_writes(hardware, startup_check):
    hw = load_hardware(hardware)
    listed = 0
    hosts = HOSTS["cpu" if hw.platform == "cpu" else "gpu"]
    for model in sorted(PRESETS):
        for tpot in TPOT_MS.get(hw.platform, (50, 100)):
            for c in plan(PRESETS[model], hw, tpot, 4096, max_devices=128).candidates:
                text = spec_toml(c, "/models/m", hosts, hw.platform)
                d = check_spec(tomllib.loads(text))
                for cmd in commands(d, ["vllm", "serve"]):
                    startup_check(hw.platform, cmd.argv)
                listed += 1
    assert listed, f"no AFD shape was listed on {hardware}"
