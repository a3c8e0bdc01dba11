"""Patch `step_failure`: a failed AFD step fails its requests, not the engine.

When one step fails inside AFD but the attention/FFN protocol is still in step (an
exception in attention or FFN compute, finished with rows of zeros), the AFD attention
runner returns a ModelRunnerOutput marked with the failure instead of raising (raising
from the worker kills vLLM's engine). This wraps `Scheduler.update_from_output`: for a
marked output it finishes every request scheduled in that step with FINISHED_ERROR (the
client gets an error, their KV blocks are freed) and lets vLLM's own bookkeeping run on the
otherwise empty output. Unmarked outputs go to vLLM's method untouched.
"""

from __future__ import annotations

from afd_core.patches.catalogue import PatchInfo, apply_when_imported, install
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="step_failure",
    why="a failed AFD step fails exactly its requests (HTTP error) and the engine goes on",
    replaces=("vllm.v1.core.sched.scheduler.Scheduler.update_from_output",),
    remove_when="vLLM lets a model runner fail the requests of one step without raising",
)

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"


def _patch(module) -> None:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus

    from afd_core.log import get_logger
    from afd_core.step.attention import STEP_FAILURE_ATTR

    logger = get_logger(__name__)
    scheduler_cls = module.Scheduler
    original = scheduler_cls.update_from_output

    def update_from_output(self, scheduler_output, model_runner_output):
        failure = getattr(model_runner_output, STEP_FAILURE_ATTR, None)
        if failure is None:
            return original(self, scheduler_output, model_runner_output)
        failed = self.finish_requests(
            list(scheduler_output.num_scheduled_tokens), RequestStatus.FINISHED_ERROR
        )
        logger.error(
            "AFD: %d request(s) of a failed step finish with an error: %s", len(failed), failure
        )
        outputs = original(self, scheduler_output, model_runner_output)
        for request in failed:
            eco = outputs.setdefault(request.client_index, EngineCoreOutputs())
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                )
            )
        return outputs

    install(INFO, scheduler_cls, "update_from_output", update_from_output)


def apply() -> tuple[StepStatus, str]:
    # only engine-core processes import (and need) the scheduler
    return apply_when_imported(INFO, SCHEDULER_MODULE, _patch, "engine-core processes")
