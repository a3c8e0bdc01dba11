"""Patch `config_validation`: check the AFD config and pick the role worker at config time.

Wraps the platform's `check_and_update_config` (classmethod), which vLLM calls once, from
VllmConfig.__post_init__ in the API-server process, before any engine, process group or
socket exists. For a config with an `afd` key it:

* parses it (AFDConfigError names the field, the value and what is allowed);
* stops if a registration step this deployment needs failed in this process;
* checks the deployment shape: an attention server's DP x TP workers are attention ranks
  start_rank.., within num_attention_ranks; an FFN server is one FFN rank (start_rank),
  its tensor-parallel workers share it, or over data parallel D FFN ranks start_rank..
  (an expert group: TP 1, no expert parallel on CPU); eager execution on CPU;
* maps worker class `auto` to the AFD worker of the role; an explicit `--worker-cls` that
  is not that worker is an error naming both;
* on the FFN role, turns prefix caching off (an engine with no KV cache groups needs it off);
* on an attention server with `afd.async_dp` and data parallelism, makes its DP ranks
  independent engines (patches async_dp_engine and async_dp_forward_context);
* resolves micro-batching (DBO) before the platform sees vLLM's flags (the CPU platform
  drops `--enable-dbo` with a warning; vLLM's own micro-batching is CUDA-only and needs a
  DeepEP all2all backend): an attention server's m comes from `afd.num_microbatches`, else
  `--enable-dbo` (2) or `--ubatch-size`; it is written back into the `afd` config every
  process receives, and vLLM's flags are turned off, because AFD's step engine does the
  splitting; a flag that cannot apply (DBO on an FFN server, m out of 1..4, thresholds
  below m, a conflicting m) stops start-up;
* refuses a KV-transfer config (--kv-transfer-config, --kv-offloading-size) on an FFN
  server, which holds no KV cache (an attention server may be a KV consumer: docs/pd.md);
* rejects what AFD cannot run yet: speculative decoding, a model architecture without an
  AFD wrapper (listing those registered), the gate on attention for a wrapper that cannot
  run it; on CUDA (`validate_cuda`): a graph mode other than FULL_DECODE_ONLY or none,
  graphs on vLLM's model runner V2, more than 2 micro-batches with graphs (vLLM's
  UBatchWrapper splits in two), FFN tensor parallel;
* on an attention server, keeps vLLM's choice of model runner (V1 or V2), made on the
  flags as given, for all its processes (`pin_model_runner`).

Installed on the current platform's class: CpuPlatform on CPU, CudaPlatformBase on CUDA
(vllm.platforms.cuda imports only where CUDA's kernels are built, so never on the other).

Then it calls vLLM's original, which leaves a non-`auto` worker class alone.
"""

from __future__ import annotations

import os

from afd_core import envs
from afd_core.capabilities import (
    ffn_server_problem,
    graph_mode_problem,
    kv_transfer_problem,
    microbatch_problem,
)
from afd_core.config import AFD_KEY, AUTO
from afd_core.connectors.protocol.control import MAX_MICROBATCHES
from afd_core.connectors.transports.gate import deployment_secret
from afd_core.log import get_logger
from afd_core.metrics import register_collector, server_root_pid
from afd_core.patches.catalogue import PatchInfo, replace_attr, require_supported_vllm
from afd_core.registration import StepStatus

logger = get_logger(__name__)

INFO = PatchInfo(
    name="config_validation",
    why="validate the afd config, map worker class 'auto' to the AFD role worker, and take "
    "over vLLM's DBO flags for AFD's micro-batching",
    replaces=(
        "vllm.platforms.cpu.CpuPlatform.check_and_update_config",
        "vllm.platforms.cuda.CudaPlatformBase.check_and_update_config",
    ),
    remove_when="vLLM lets a plugin choose the worker class per config (no such hook in 0.32)",
)


class AFDDeploymentError(ValueError):
    pass


def resolve_microbatches(afd, pc) -> int:
    """Micro-batches per step for this server; raises naming the flags that conflict."""
    asked = []
    if pc.enable_dbo:
        asked.append("--enable-dbo")
    if pc.ubatch_size > 1:
        asked.append(f"--ubatch-size={pc.ubatch_size}")
    if afd.num_microbatches is not None and afd.num_microbatches != 1:
        asked.append(f"afd.num_microbatches={afd.num_microbatches}")
    if afd.is_ffn:
        if asked:
            raise AFDDeploymentError(
                f"AFD: {', '.join(asked)} on an FFN server: micro-batching (DBO) is set on the "
                "attention servers, and an FFN server serves whatever micro-batches its peers "
                "announce; remove it from the FFN server"
            )
        return 1
    if afd.adaptive_microbatches:
        return resolve_adaptive_microbatches(pc)
    m = afd.num_microbatches
    if m is None:
        m = pc.num_ubatches if pc.use_ubatching else 1
    elif pc.ubatch_size > 1 and pc.ubatch_size != m:
        raise AFDDeploymentError(
            f"AFD: --ubatch-size={pc.ubatch_size} and afd.num_microbatches={m} disagree; "
            "give one of them"
        )
    elif m == 1 and pc.enable_dbo:
        raise AFDDeploymentError(
            "AFD: --enable-dbo asks for micro-batches but afd.num_microbatches=1 for none; "
            "drop one of them (afd.num_microbatches 2..4 sets how many with --enable-dbo)"
        )
    if not 1 <= m <= MAX_MICROBATCHES:
        raise AFDDeploymentError(
            f"AFD: {m} micro-batches per step ({', '.join(asked)}); allowed 1..{MAX_MICROBATCHES}"
        )
    low = min(pc.dbo_decode_token_threshold, pc.dbo_prefill_token_threshold)
    if m > 1 and low < m:
        raise AFDDeploymentError(
            f"AFD: --dbo-decode-token-threshold={pc.dbo_decode_token_threshold} and "
            f"--dbo-prefill-token-threshold={pc.dbo_prefill_token_threshold} must both be at "
            f"least the number of micro-batches ({m}): a step is split only when every "
            "micro-batch can get a token"
        )
    return m


def resolve_adaptive_microbatches(pc) -> int:
    """`afd.num_microbatches: "auto"`: each step picks m in 1..4 (afd_core.step.tuner);
    returns the most a step may have."""
    if pc.ubatch_size > 1:
        raise AFDDeploymentError(
            f"AFD: --ubatch-size={pc.ubatch_size} and afd.num_microbatches='auto' disagree; "
            "give one of them"
        )
    if pc.tensor_parallel_size > 1:
        raise AFDDeploymentError(
            f"AFD: afd.num_microbatches='auto' with --tensor-parallel-size="
            f"{pc.tensor_parallel_size}: each TP rank would measure and choose on its own, "
            "but the TP ranks of a step must split it alike; allowed: a fixed "
            f"afd.num_microbatches (1..{MAX_MICROBATCHES}) with tensor parallel"
        )
    low = min(pc.dbo_decode_token_threshold, pc.dbo_prefill_token_threshold)
    if low < 2:
        raise AFDDeploymentError(
            f"AFD: --dbo-decode-token-threshold={pc.dbo_decode_token_threshold} and "
            f"--dbo-prefill-token-threshold={pc.dbo_prefill_token_threshold} must both be at "
            "least 2 with afd.num_microbatches='auto' (the smallest split)"
        )
    return MAX_MICROBATCHES


def validate_expert_group(afd, pc, device_type: str) -> None:
    """An FFN server with --data-parallel-size D: FFN ranks start_rank..start_rank+D-1 that
    run their MoE layers as one vLLM data-parallel group (afd_core.step.expert_group)."""
    dp = pc.data_parallel_size
    problem = ffn_server_problem(
        device_type, pc.tensor_parallel_size, dp, bool(pc.enable_expert_parallel)
    )
    if problem:
        raise AFDDeploymentError(problem)
    if afd.start_rank + dp > afd.num_ffn_ranks:
        raise AFDDeploymentError(
            f"afd config: this FFN server runs --data-parallel-size={dp} FFN ranks "
            f"{afd.start_rank}..{afd.start_rank + dp - 1}, but the deployment has "
            f"num_ffn_ranks={afd.num_ffn_ranks} (0..{afd.num_ffn_ranks - 1}); raise "
            "num_ffn_ranks or lower start_rank / --data-parallel-size"
        )


def validate_deployment(afd, vllm_config, device_type: str) -> None:
    pc = vllm_config.parallel_config
    workers = pc.data_parallel_size * pc.tensor_parallel_size
    if pc.pipeline_parallel_size != 1:
        raise AFDDeploymentError(
            f"AFD: --pipeline-parallel-size={pc.pipeline_parallel_size} is not supported; "
            "allowed: 1"
        )
    if vllm_config.speculative_config is not None:
        method = getattr(vllm_config.speculative_config, "method", None)
        raise AFDDeploymentError(
            f"AFD: speculative decoding (--speculative-config, method {method!r}) is not "
            "supported yet: its draft/MTP layers' MLPs would be sent to the FFN ranks, which "
            "do not hold them; start without --speculative-config"
        )
    problem = kv_transfer_problem(
        afd.role,
        vllm_config.kv_transfer_config is not None,
        getattr(vllm_config.cache_config, "kv_offloading_size", None) is not None,
    )
    if problem:
        raise AFDDeploymentError(problem)
    if afd.is_attention and afd.start_rank + workers > afd.num_attention_ranks:
        raise AFDDeploymentError(
            f"afd config: this attention server runs {workers} workers (data parallel "
            f"{pc.data_parallel_size} x tensor parallel {pc.tensor_parallel_size}) as attention "
            f"ranks {afd.start_rank}..{afd.start_rank + workers - 1}, but the deployment has "
            f"num_attention_ranks={afd.num_attention_ranks} (0..{afd.num_attention_ranks - 1}); "
            "raise num_attention_ranks or lower start_rank / --data-parallel-size"
        )
    if afd.is_ffn and pc.data_parallel_size > 1:
        validate_expert_group(afd, pc, device_type)
    from vllm.config import CompilationMode

    if device_type == "cuda":
        validate_cuda(afd, vllm_config)
    if device_type == "cpu" and vllm_config.compilation_config.mode != CompilationMode.NONE:
        raise AFDDeploymentError(
            "AFD on CPU runs the model eagerly (the layer exchange is Python code that "
            "torch.compile must not trace): add --enforce-eager"
        )


def pin_model_runner(vllm_config) -> bool:
    """vLLM's choice of model runner for this attention server, made on the flags it was
    given, kept for its processes (and the engine and workers they start): returns whether
    it is model runner V2.

    vLLM decides on every read (`VllmConfig.use_v2_model_runner`: V2 wherever Triton runs,
    V1 for what V2 lacks, DBO among it unless VLLM_USE_V2_MODEL_RUNNER is set). AFD then
    turns vLLM's micro-batching off here and on again in the worker, for AFD's own split
    (role_workers): unpinned, the worker would build one runner and the scheduler, made
    after it in the same engine process, would decide for the other."""
    use_v2 = bool(vllm_config.use_v2_model_runner)
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if use_v2 else "0"
    logger.info("AFD: vLLM's %s model runner", "V2" if use_v2 else "V1")
    return use_v2


def validate_cuda(afd, vllm_config) -> None:
    """What the CUDA path does not run yet, each with its alternative."""
    from afd_core.step.graphs import graph_mode_name

    name = graph_mode_name(vllm_config)
    if getattr(vllm_config, "use_v2_model_runner", False) and name != "NONE":
        raise AFDDeploymentError(
            f"AFD on CUDA: vLLM's model runner V2 with cudagraph_mode={name} is not "
            "supported: V2 replays a FULL graph without calling the model (its cudagraph "
            "manager's run_fullgraph), so AFD's control message would not go out before "
            "a replayed step; allowed: --enforce-eager on V2, or graphs on the V1 runner "
            "(VLLM_USE_V2_MODEL_RUNNER=0)"
        )
    if graph_mode_problem("cuda", name):  # the message below says what vLLM defaults to
        raise AFDDeploymentError(
            f"AFD on CUDA: cudagraph_mode={name} is not supported (vLLM's default is "
            "FULL_AND_PIECEWISE); allowed: FULL_DECODE_ONLY (pass --compilation-config "
            '\'{"cudagraph_mode": "FULL_DECODE_ONLY"}\') or none (--enforce-eager)'
        )
    if afd.connector == "nccl":
        from afd_core.connectors.transports.nccl import check_pynccl_enabled

        check_pynccl_enabled()
    pc = vllm_config.parallel_config
    problem = afd.is_ffn and ffn_server_problem("cuda", pc.tensor_parallel_size, 1)
    if problem:
        raise AFDDeploymentError(problem)


def validate_cuda_microbatches(m: int, vllm_config, adaptive: bool = False) -> None:
    """DBO with graphs runs through vLLM's UBatchWrapper, which splits in two; eagerly,
    AFD's own executor runs up to 4 (afd_core.step.vllm_ubatch)."""
    from afd_core.step.graphs import graph_mode_name

    mode = graph_mode_name(vllm_config)
    pc = vllm_config.parallel_config
    if adaptive and (problem := microbatch_problem("cuda", m, mode, adaptive=True)):
        raise AFDDeploymentError(problem)
    if m > 1 and mode != "NONE" and pc.data_parallel_size > 1 and pc.is_moe_model is False:
        # vLLM makes DP metadata for MoE models only, and its UBatchWrapper asserts it
        # under data parallel (gpu_ubatch_wrapper.py, __call__)
        raise AFDDeploymentError(
            f"AFD on CUDA: {m} micro-batches per step (DBO) with cudagraph_mode={mode} and "
            f"--data-parallel-size={pc.data_parallel_size} needs a MoE model (vLLM's "
            "UBatchWrapper requires the DP metadata it makes for MoE models only); allowed: "
            "--enforce-eager, afd.num_microbatches=1, or --data-parallel-size 1"
        )
    if not adaptive and (problem := microbatch_problem("cuda", m, mode)):
        raise AFDDeploymentError(problem)


def afd_architectures() -> list[str]:
    """The architectures with an AFD wrapper registered in vLLM's registry (register_afd)."""
    from vllm.model_executor.models import ModelRegistry

    return sorted(a[3:] for a in ModelRegistry.get_supported_archs() if a.startswith("AFD"))


def _wrapper(arch: str):
    """The AFD wrapper class of `arch`; AFDDeploymentError when it cannot be imported here
    (a dependency the model's vLLM module needs is missing)."""
    from vllm.model_executor.models import ModelRegistry

    registered = ModelRegistry.models["AFD" + arch]
    try:
        return registered.load_model_cls()
    except ImportError as exc:
        raise AFDDeploymentError(
            f"AFD: the wrapper of {arch} cannot be imported here: {type(exc).__name__}: "
            f"{exc} (vLLM's module for this model needs it; install it next to vLLM)"
        ) from exc


def _not_runnable(arch: str) -> str | None:
    try:
        return getattr(_wrapper(arch), "afd_not_implemented", None)
    except AFDDeploymentError as exc:
        return str(exc)


def runnable_architectures() -> str:
    """What an error says AFD can run here: the registered wrappers that are implemented
    and importable."""
    names = afd_architectures()
    pending = [a for a in names if _not_runnable(a)]
    runs = ", ".join(a for a in names if a not in pending)
    return runs + (f" (registered, not runnable here: {', '.join(pending)})" if pending else "")


def validate_model(afd, vllm_config) -> None:
    """The checkpoint's architecture has an AFD wrapper that can run this config."""
    archs = list(getattr(vllm_config.model_config.hf_config, "architectures", None) or [])
    arch = archs[0] if archs else None
    if arch not in afd_architectures():
        raise AFDDeploymentError(
            f"AFD: the model's architecture {arch!r} has no AFD wrapper; AFD runs: "
            + runnable_architectures()
        )
    wrapper = _wrapper(arch)
    if reason := getattr(wrapper, "afd_not_implemented", None):
        raise AFDDeploymentError(f"AFD: {reason}; AFD runs: {runnable_architectures()}")
    if afd.compute_gate_on_attention and not getattr(wrapper, "supports_gate_on_attention", False):
        gated = [
            a
            for a in afd_architectures()
            if not _not_runnable(a) and getattr(_wrapper(a), "supports_gate_on_attention", False)
        ]
        raise AFDDeploymentError(
            f"afd config: compute_gate_on_attention=True is not supported for {arch} "
            f"({wrapper.__name__} runs the router on the FFN side); allowed: false. These "
            f"run it on attention: {', '.join(gated)}"
        )


def _prefix_caching_off(vllm_config) -> None:
    """An FFN engine has no KV cache groups: prefix caching off. vLLM has already sized a
    hybrid (linear-attention) model's state cache for prefix caching by then ("align"
    mode, a block-sized mamba block); give it what vLLM chooses without prefix caching."""
    cache = vllm_config.cache_config
    cache.enable_prefix_caching = False
    if getattr(cache, "mamba_cache_mode", "none") == "align":
        cache.mamba_cache_mode = "none"
        cache.mamba_block_size = vllm_config.model_config.max_model_len


def prepare_afd_config(device_type: str, vllm_config):
    """Everything this patch checks and decides before the platform's own hook, except the
    worker class: (the afd config, micro-batches per step), or None without an `afd` key.
    Ascend's patch (afd-npu) calls it too, then picks the worker after vLLM-Ascend's hook."""
    from afd_core.config import parse_optional_afd_config
    from afd_core.registration import assert_steps_ok_for

    afd = parse_optional_afd_config(vllm_config.additional_config, device_type=device_type)
    if afd is None:
        return None
    assert_steps_ok_for(afd)
    deployment_secret()  # a secret set but unreadable or too short: named before anything
    envs.mark_deployment(afd.role)  # deferred patches then gate this server's processes
    pc = vllm_config.parallel_config
    # the ranks' afd_* metrics on this server's /metrics (each API server process's)
    api = getattr(pc, "_api_process_count", 1), getattr(pc, "_api_process_rank", 0)
    register_collector(server_root_pid(*api))
    validate_deployment(afd, vllm_config, device_type)
    validate_model(afd, vllm_config)
    if (ranks := ranks_across_hosts(afd, pc)) is not None:
        envs.mark_server_ranks(ranks)  # before async DP makes each engine's config DP size 1
    m = resolve_microbatches(afd, pc)
    if device_type == "cuda":
        validate_cuda_microbatches(m, vllm_config, adaptive=afd.adaptive_microbatches)
    if afd.is_attention:
        adaptive = afd.adaptive_microbatches
        vllm_config.additional_config[AFD_KEY]["num_microbatches"] = AUTO if adaptive else m
        if m > 1:
            logger.info(
                "AFD: %s micro-batches per step above %d decode / %d prefill tokens",
                f"1..{m}, chosen per step from measured steps," if adaptive else m,
                pc.dbo_decode_token_threshold,
                pc.dbo_prefill_token_threshold,
            )
    if afd.is_attention:
        pin_model_runner(vllm_config)
    # AFD's step engine splits steps; vLLM's micro-batching stays off
    pc.enable_dbo = False
    pc.ubatch_size = 0
    if afd.is_ffn:
        _prefix_caching_off(vllm_config)
    if afd.is_attention and afd.async_dp and pc.data_parallel_size > 1:
        from afd_core.patches import async_dp_engine, async_dp_forward_context

        async_dp_engine.make_independent(vllm_config)
        async_dp_forward_context.skip_dp_metadata(vllm_config)
        logger.info(
            "AFD: async DP: the %d data-parallel ranks of this attention server step "
            "independently (no DP waves, no dummy forwards)",
            pc.data_parallel_size,
        )
    return afd, m


def ranks_across_hosts(afd, pc) -> range | None:
    """This server's ranks of its role if it spans hosts (vLLM's multi-node flags: some of
    its data-parallel ranks, or nodes, on another host), else None. Its API server, on the
    head host, sees that host's processes only: the ranks share their metrics through the
    rendezvous store then (`AFDConnector.share_metrics`)."""
    if pc.data_parallel_size_local >= pc.data_parallel_size and pc.nnodes <= 1:
        return None
    per_dp_rank = 1 if afd.is_ffn else pc.tensor_parallel_size
    return range(afd.start_rank, afd.start_rank + pc.data_parallel_size * per_dp_rank)


def _check_and_update_config(original, cls, vllm_config) -> None:
    from afd_core.workers.selection import resolve_worker_cls

    prepared = prepare_afd_config(cls.device_type, vllm_config)
    if prepared is not None:
        pc = vllm_config.parallel_config
        pc.worker_cls = resolve_worker_cls(pc.worker_cls, cls.device_type, prepared[0].role)
    original(vllm_config)


def wrap_check_and_update_config(platform_cls, hook, patch: str = INFO.name):
    """Replace the classmethod `platform_cls.check_and_update_config` by one that calls
    `hook(original, cls, vllm_config)` (original: the bound method it replaced); once per
    class. Returns the new classmethod's function."""
    original = platform_cls.check_and_update_config  # bound classmethod

    def check_and_update_config(cls, vllm_config):
        return hook(original, cls, vllm_config)

    check_and_update_config.__afd_patch__ = patch
    replace_attr(platform_cls, "check_and_update_config", classmethod(check_and_update_config))
    return check_and_update_config


def refuse_afd_on(platform_cls, reason: str) -> None:
    """Where AFD's config patch could not be installed: a config with an `afd` key stops at
    start-up with `reason` (instead of running the platform's own worker without AFD);
    any other config is the platform's as before."""

    def refuse(original, cls, vllm_config):
        additional = getattr(vllm_config, "additional_config", None)
        if isinstance(additional, dict) and AFD_KEY in additional:
            raise AFDDeploymentError(
                f"AFD cannot run on platform {getattr(cls, 'device_type', '?')!r}: {reason}"
            )
        return original(vllm_config)

    wrap_check_and_update_config(platform_cls, refuse)


# the class whose check_and_update_config is wrapped, per platform device type
PLATFORM_CLASSES = {
    "cpu": ("vllm.platforms.cpu", "CpuPlatform"),
    "cuda": ("vllm.platforms.cuda", "CudaPlatformBase"),
}


def install_on(platform_cls) -> None:
    """Wrap `platform_cls.check_and_update_config` (a classmethod); once per class."""
    wrap_check_and_update_config(platform_cls, _check_and_update_config)


def apply() -> tuple[StepStatus, str]:
    require_supported_vllm(INFO.name)
    import importlib

    from vllm.platforms import current_platform

    device = current_platform.device_type
    if device not in PLATFORM_CLASSES:
        return StepStatus.SKIPPED, (
            f"platform {device!r}: its own config patch applies (Ascend: afd-npu), or AFD "
            f"does not run there (supported: {', '.join(PLATFORM_CLASSES)}, npu)"
        )
    module, name = PLATFORM_CLASSES[device]
    install_on(getattr(importlib.import_module(module), name))
    return StepStatus.APPLIED, ""
