"""What `register_afd` did in this process, step by step.

vLLM loads general plugins in every process (API server, engine core, workers, model
inspection), AFD deployment or not, so `register_afd` must not fail loudly for a step a
process does not need. It records each step's outcome here instead; when an AFD config is
parsed, `assert_steps_ok_for` stops start-up if that deployment needs a step that failed.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from afd_core.config import AFDConfig


class StepStatus(enum.Enum):
    APPLIED = "applied"
    FAILED = "failed"
    NOT_IMPLEMENTED = "not implemented"
    SKIPPED = "skipped"  # not needed on this platform (e.g. the Ascend patch on CPU)
    # registered to happen when vLLM imports the module it touches (see import_hooks);
    # a process that never imports it never needs it
    DEFERRED = "deferred"


@dataclass(frozen=True)
class StepRecord:
    name: str
    status: StepStatus
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status in (StepStatus.APPLIED, StepStatus.SKIPPED, StepStatus.DEFERRED)


# Names of the registration steps; the patch steps are "patch:<module>".
STEP_VERSION_CHECK = "version_check"
STEP_ROUTING_STRATEGY = "routing_strategy:afd_balanced"
STEP_DBO_YIELD_OP = "custom_op:manual_dbo_yield"
STEP_ASCEND_CONFIG = "patch:ascend_config"
STEP_MODELS = "model_registration"


def patch_step(module: str) -> str:
    return f"patch:{module}"


_lock = threading.Lock()
_records: dict[str, StepRecord] = {}


def record(name: str, status: StepStatus, reason: str = "") -> StepRecord:
    rec = StepRecord(name, status, reason)
    with _lock:
        _records[name] = rec
    return rec


def records() -> dict[str, StepRecord]:
    with _lock:
        return dict(_records)


def clear() -> None:
    """Forget every record (tests only)."""
    with _lock:
        _records.clear()


# Needed by every AFD deployment (the Ascend step is recorded SKIPPED off NPU, so only an
# NPU failure counts).
ALWAYS_NEEDED = (
    patch_step("config_validation"),  # maps worker class "auto" to the role worker
    patch_step("engine_core"),  # FFN server mode
    patch_step("step_failure"),  # a failed step fails its requests, not the engine
    patch_step("health"),  # /health says not ready while no FFN rank serves the server
    patch_step("mrv2_ubatch_runner"),  # on model runner V2, AFD alone splits steps
    STEP_DBO_YIELD_OP,  # the attention-side proxy calls it between send and receive
    STEP_MODELS,
    STEP_ASCEND_CONFIG,
)


def steps_needed_by(config: AFDConfig) -> list[str]:
    """The registration steps a deployment with this config cannot run without."""
    from afd_core import envs

    needed = list(ALWAYS_NEEDED)
    if config.async_dp:
        needed += [patch_step("async_dp_engine"), patch_step("async_dp_forward_context")]
    if envs.balanced_routing_requested():
        needed.append(STEP_ROUTING_STRATEGY)
    return needed


class AFDStartupError(RuntimeError):
    """An AFD deployment cannot start because a registration step it needs failed."""


def assert_steps_ok_for(config: AFDConfig) -> None:
    """Raise AFDStartupError naming every needed step that failed in this process.

    Steps never recorded (register_afd did not run here, e.g. a unit test) do not count.
    """
    recs = records()
    bad = [recs[n] for n in steps_needed_by(config) if n in recs and not recs[n].ok]
    if bad:
        lines = "; ".join(f"{r.name} ({r.status.value}: {r.reason})" for r in bad)
        raise AFDStartupError(
            f"AFD role {config.role!r} cannot start: required plugin step(s) failed in this "
            f"process: {lines}. Run `afd doctor` for details."
        )
