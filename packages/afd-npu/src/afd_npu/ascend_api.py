"""The vLLM-Ascend API afd-npu patches or subclasses, pinned.

afd-npu was written against vllm-ascend 0.23.0.post1's source (the newest release; none
targets vLLM 0.32 yet, so it is built from source against vLLM 0.32). Each entry names a
function or class method AFD wraps, calls or subclasses and the leading parameters AFD
relies on. `check_ascend_api("patch")` runs before the Ascend patch installs anything (a
vllm-ascend whose API drifted fails that registration step with the name of what changed,
and `afd doctor` shows it), `check_ascend_api("worker")` when AFD's NPU workers are
imported, instead of failing later inside a worker. The test stand-ins
(tests/afd_npu/standin) are checked against the same pins.
"""

from __future__ import annotations

import importlib
import inspect

# "module:qualname" -> the parameters AFD relies on, in order (a prefix of the signature)
PINNED: dict[str, tuple[str, ...]] = {
    "vllm_ascend.ascend_config:init_ascend_config": ("vllm_config",),
    "vllm_ascend.ascend_config:AscendConfig.__init__": ("self", "vllm_config"),
    "vllm_ascend.platform:NPUPlatform.check_and_update_config": ("vllm_config",),
    "vllm_ascend.worker.worker:NPUWorker.__init__": (
        "self",
        "vllm_config",
        "local_rank",
        "rank",
        "distributed_init_method",
        "is_driver_worker",
    ),
    "vllm_ascend.worker.worker:NPUWorker.init_device": ("self",),
    "vllm_ascend.worker.worker:NPUWorker.load_model": ("self",),
    "vllm_ascend.worker.worker:NPUWorker.compile_or_warm_up_model": ("self",),
    "vllm_ascend.worker.worker:NPUWorker.get_kv_cache_spec": ("self",),
    "vllm_ascend.worker.worker:NPUWorker.initialize_from_config": ("self", "kv_cache_config"),
    "vllm_ascend.worker.worker:NPUWorker.execute_model": ("self", "scheduler_output"),
    "vllm_ascend.worker.worker:NPUWorker.sample_tokens": ("self", "grammar_output"),
    "vllm_ascend.worker.worker:NPUWorker.shutdown": ("self",),
    "vllm_ascend.worker.model_runner_v1:NPUModelRunner.__init__": (
        "self",
        "vllm_config",
        "device",
    ),
    "vllm_ascend.worker.model_runner_v1:NPUModelRunner._determine_batch_execution_and_padding": (
        "self",
        "num_tokens",
        "num_reqs",
        "num_scheduled_tokens_np",
        "max_num_scheduled_tokens",
        "use_cascade_attn",
    ),
    "vllm_ascend.worker.model_runner_v1:NPUModelRunner._dummy_run": ("self", "num_tokens"),
    "vllm_ascend.worker.model_runner_v1:NPUModelRunner.execute_model": (
        "self",
        "scheduler_output",
        "intermediate_tensors",
    ),
    "vllm_ascend.worker.model_runner_v1:NPUModelRunner.get_model": ("self",),
    "vllm_ascend.ascend_forward_context:set_ascend_forward_context": (
        "attn_metadata",
        "vllm_config",
        "num_tokens",
        "num_tokens_across_dp",
    ),
}
# keyword parameters AFD passes by name (anywhere in the signature)
PINNED_KEYWORDS: dict[str, tuple[str, ...]] = {
    "vllm_ascend.ascend_forward_context:set_ascend_forward_context": ("input_ids",),
    "vllm_ascend.worker.model_runner_v1:NPUModelRunner._dummy_run": ("is_profile",),
}
# where vLLM-Ascend's platform maps worker class "auto" on a plain NPU (910B/910C)
ASCEND_DEFAULT_WORKER = "vllm_ascend.worker.worker.NPUWorker"


class AscendAPIError(RuntimeError):
    pass


def resolve(target: str):
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def drift(target: str) -> str | None:
    """What differs between the installed vllm-ascend and the pin of `target`, or None."""
    try:
        obj = resolve(target)
    except (ImportError, AttributeError) as exc:
        return f"{target} is missing ({type(exc).__name__}: {exc})"
    signature = inspect.signature(inspect.unwrap(obj)).parameters
    params = list(signature)
    want = PINNED.get(target, ())
    shown = f"{target} takes ({', '.join(params)})"
    if tuple(params[: len(want)]) != want:
        return f"{shown}; AFD expects it to start with ({', '.join(want)})"
    # a new parameter without a default: the calls AFD makes (or wraps) do not pass it
    required = [
        n
        for n in params[len(want) :]
        if signature[n].default is inspect.Parameter.empty
        and signature[n].kind
        not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if required:
        return f"{shown}; AFD does not pass {', '.join(required)}"
    missing = [k for k in PINNED_KEYWORDS.get(target, ()) if k not in params]
    if missing:
        return f"{shown}; AFD passes {', '.join(missing)} by name"
    return None


# what the config patch touches (checked by register_afd in every process); the rest is
# checked where AFD's NPU workers are imported (worker processes), so a server process
# never imports vLLM-Ascend's worker modules just to check them
PATCH_MODULES = ("vllm_ascend.ascend_config", "vllm_ascend.platform")


def check_ascend_api(scope: str = "all") -> None:
    """Raise AscendAPIError naming every pinned function that changed. scope: "patch" (the
    config patch's modules), "worker" (the others) or "all"."""
    if scope not in ("patch", "worker", "all"):
        raise ValueError(f"scope={scope!r}; allowed 'patch', 'worker' or 'all'")

    def in_scope(target: str) -> bool:
        patch = target.split(":")[0] in PATCH_MODULES
        return scope == "all" or patch == (scope == "patch")

    problems = [d for t in PINNED if in_scope(t) and (d := drift(t))]
    if problems:
        raise AscendAPIError(
            "vllm-ascend's API differs from the one afd-npu was written for (vllm-ascend "
            "0.23.0.post1 built against vLLM 0.32): " + "; ".join(problems)
        )
