"""Each server of a deployment spec checked as the server itself will check it at start-up:
its rendered `afd` config through `parse_afd_config`, and its shape, graph mode and
micro-batches through the start-up rules (afd_core.capabilities, the config patch's
`resolve_microbatches`), so a spec that would stop at start-up is refused before anything
starts. Also the `vllm serve` flags a spec owns, which a server's `args` may not repeat.

Only the flags these rules read are parsed from `args` (vLLM's own parser takes seconds to
import); vLLM's defaults for them are pinned in tests/afd_plugin/test_deploy_spec.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

from afd_core.capabilities import (
    async_dp_problem,
    ffn_server_problem,
    graph_mode_problem,
    kv_transfer_problem,
    microbatch_problem,
)

# flags the spec writes from its own fields: a server's `args` repeating one would win
# over the spec (argparse keeps the last) while probes, Services and peers use the spec's
OWNED_FLAGS = {
    "--host": "hosts.<name>.address",
    "--port": "servers[].port",
    "--headless": "servers[].hosts (the hosts after the first run headless)",
    "--data-parallel-size": "servers[].data_parallel_size",
    "-dp": "servers[].data_parallel_size",
    "--data-parallel-size-local": "servers[].hosts[].ranks",
    "-dpl": "servers[].hosts[].ranks",
    "--data-parallel-start-rank": "servers[].hosts (the order of the placements)",
    "-dpr": "servers[].hosts (the order of the placements)",
    "--data-parallel-rank": "servers[].hosts (the order of the placements)",
    "-dpn": "servers[].hosts (the order of the placements)",
    "--data-parallel-address": "hosts.<name>.address (of the server's first host)",
    "-dpa": "hosts.<name>.address (of the server's first host)",
    "--data-parallel-rpc-port": "servers[].data_parallel_rpc_port",
    "-dpp": "servers[].data_parallel_rpc_port",
    "--tensor-parallel-size": "servers[].tensor_parallel_size",
    "-tp": "servers[].tensor_parallel_size",
    "--additional-config": "[afd] (and the spec's own fields)",
    "--served-model-name": "served_model_name",
    "--model": "model",
}
# vLLM's defaults for the flags read below (ParallelConfig; pinned in a test)
DBO_DECODE_TOKEN_THRESHOLD = 32
DBO_PREFILL_TOKEN_THRESHOLD = 512
# the cudagraph mode vLLM picks when a server's flags leave graphs on (its default)
VLLM_DEFAULT_GRAPH_MODE = "FULL_AND_PIECEWISE"


def _flag(arg: str) -> str:
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def owned_flag_problem(args: list[str], prefill: bool = False) -> str | None:
    """A flag of `args` the spec writes itself. A prefill server (plain vLLM) may take
    --additional-config, without an `afd` key."""
    for i, arg in enumerate(args):
        if prefill and _flag(arg) == "--additional-config":
            value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1 : i + 2] or [""])[0]
            try:
                config = json.loads(value)
            except ValueError:
                config = None
            if isinstance(config, dict) and "afd" in config:
                return (
                    "--additional-config holds an 'afd' key; a prefill server is an ordinary "
                    "vLLM server: allowed: --additional-config without 'afd'"
                )
            continue
        if arg.startswith("-") and _flag(arg) in OWNED_FLAGS:
            return (
                f"{arg.split('=', 1)[0]} is set by the spec itself; allowed: set "
                f"{OWNED_FLAGS[_flag(arg)]} in the spec instead"
            )
    return None


@dataclass(frozen=True)
class ServeFlags:
    """What a server's `vllm serve` flags (defaults, then its args) decide for AFD."""

    graph_mode: str
    enable_dbo: bool = False
    ubatch_size: int = 0
    dbo_decode_token_threshold: int = DBO_DECODE_TOKEN_THRESHOLD
    dbo_prefill_token_threshold: int = DBO_PREFILL_TOKEN_THRESHOLD
    expert_parallel: bool = False
    kv_transfer: bool = False  # --kv-transfer-config (whole or dotted: --kv-transfer-config.x)
    kv_offloading: bool = False  # --kv-offloading-size, which vLLM turns into a KV connector


def _values(args: list[str]) -> list[tuple[str, str | None]]:
    """(flag, value or None) in order; a value is the `=` part or the next non-flag."""
    out = []
    for i, arg in enumerate(args):
        if not arg.startswith("-"):
            continue
        if "=" in arg:
            out.append((_flag(arg), arg.split("=", 1)[1]))
        else:
            nxt = args[i + 1] if i + 1 < len(args) else None
            out.append((_flag(arg), nxt if nxt is not None and not nxt.startswith("-") else None))
    return out


def serve_flags(platform: str, default_graph_flags: list[str], args: list[str]) -> ServeFlags:
    """The flags the spec renders for the server: `default_graph_flags` (the platform's,
    unless its args choose) and then its args, read as vLLM reads them (the last wins)."""
    fields: dict = {"graph_mode": None}
    for flag, value in _values([*default_graph_flags, *args]):
        if flag == "--enforce-eager":
            fields["graph_mode"] = "NONE"
        elif flag in ("--compilation-config", "-cc") and value is not None:
            try:
                mode = json.loads(value).get("cudagraph_mode")
            except (ValueError, AttributeError):
                raise ValueError(f"{flag} {value!r} is not a JSON object") from None
            if mode is not None and fields["graph_mode"] != "NONE":
                fields["graph_mode"] = str(mode).upper()
        elif flag.startswith("-O") and not flag.startswith("--"):
            level = flag[2:] or (value or "")
            if level == "0" and fields["graph_mode"] is None:
                fields["graph_mode"] = "NONE"
        elif flag == "--enable-dbo":
            fields["enable_dbo"] = True
        elif flag in ("--enable-expert-parallel", "-ep"):
            fields["expert_parallel"] = True
        elif flag.split(".", 1)[0] == "--kv-transfer-config":
            fields["kv_transfer"] = True
        elif flag == "--kv-offloading-size":
            fields["kv_offloading"] = True
        elif flag in (
            "--ubatch-size",
            "--dbo-decode-token-threshold",
            "--dbo-prefill-token-threshold",
        ):
            if value is None or not value.isdigit():
                raise ValueError(f"{flag} {value!r} is not a whole number")
            fields[flag[2:].replace("-", "_")] = int(value)
    if fields["graph_mode"] is None:  # neither eager nor a mode: vLLM's default graphs
        fields["graph_mode"] = VLLM_DEFAULT_GRAPH_MODE
    return ServeFlags(**fields)


def startup_problem(afd, platform: str, flags: ServeFlags, tp: int, dp: int) -> str | None:
    """What this server's start-up check would stop on (None: it starts), from its parsed
    `afd` config, its flags and its tensor/data-parallel sizes."""
    from afd_core.patches.config_validation import AFDDeploymentError, resolve_microbatches

    problem = graph_mode_problem(platform, flags.graph_mode)
    if problem:
        return problem + "; the spec adds the platform's flags unless a server's args choose"
    if problem := kv_transfer_problem(afd.role, flags.kv_transfer, flags.kv_offloading):
        return problem
    pc = SimpleNamespace(
        enable_dbo=flags.enable_dbo,
        ubatch_size=flags.ubatch_size,
        use_ubatching=flags.enable_dbo or flags.ubatch_size > 1,
        num_ubatches=2 if flags.enable_dbo else flags.ubatch_size,
        dbo_decode_token_threshold=flags.dbo_decode_token_threshold,
        dbo_prefill_token_threshold=flags.dbo_prefill_token_threshold,
        tensor_parallel_size=tp,
    )
    try:
        m = resolve_microbatches(afd, pc)
    except AFDDeploymentError as exc:
        return str(exc)
    if afd.is_ffn:
        return ffn_server_problem(platform, tp, dp, flags.expert_parallel)
    return microbatch_problem(platform, m, flags.graph_mode, adaptive=afd.adaptive_microbatches)


@dataclass(frozen=True)
class KVTransfer:
    """What a server's `--kv-transfer-config` says (the whole JSON, or dotted flags such as
    `--kv-transfer-config.kv_role`; the last of each key wins, as in vLLM)."""

    connector: str | None
    role: str | None


def kv_transfer(args: list[str]) -> KVTransfer | None:
    """The server's KV-transfer config, None without one; ValueError for JSON that is
    not an object."""
    config: dict = {}
    found = False
    for flag, value in _values(args):
        name, _, key = flag.partition(".")
        if name != "--kv-transfer-config":
            continue
        found = True
        if not key:
            try:
                whole = json.loads(value or "")
            except ValueError:
                whole = None
            if not isinstance(whole, dict):
                raise ValueError(f"--kv-transfer-config {value!r} is not a JSON object")
            config |= whole
        elif value is not None:
            config[key.replace("-", "_")] = value
    if not found:
        return None
    connector, role = config.get("kv_connector"), config.get("kv_role")
    return KVTransfer(
        str(connector) if connector is not None else None, str(role) if role else None
    )


def deployment_problem(afd_keys: dict, has_ffn_group: bool) -> str | None:
    return async_dp_problem(bool(afd_keys.get("async_dp")), has_ffn_group)
