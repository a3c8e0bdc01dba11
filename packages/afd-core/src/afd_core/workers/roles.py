"""Role logic shared by every platform's AFD workers.

`AttentionRole`: builds the connector, installs it for the model's FFN proxies, and sends
the per-step control message from a forward pre-hook on the model, the one point every
forward (real steps, DP dummy batches, profiling runs) passes through.
`FFNRole`: builds the connector and runs the serving loop in a thread: control message,
then per layer and micro-batch receive, compute, send, in protocol order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

from afd_core.config import require_afd_config
from afd_core.connectors.base import AFDConnector, AFDPeerError, WireSpec
from afd_core.connectors.factory import build_connector
from afd_core.log import get_logger
from afd_core.registration import assert_steps_ok_for
from afd_core.runtime import install_connector

logger = get_logger(__name__)


def role_rank(vllm_config, tp_rank: int) -> int:
    """Attention/FFN rank of this worker: (global DP index) * TP size + TP rank."""
    pc = vllm_config.parallel_config
    return pc.data_parallel_index * pc.tensor_parallel_size + tp_rank


def torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def afd_architecture(model_config) -> Iterator[None]:
    """While loading, resolve the checkpoint's architecture to its AFD wrapper ("AFD"+arch).

    Only this worker's copy of the config changes, and only for the duration of the load;
    vLLM's registry then builds the wrapper registered by register_afd.
    """
    hf = model_config.hf_config
    original = list(getattr(hf, "architectures", None) or [])
    from afd_core.registration import STEP_MODELS, records

    if not original:
        raise RuntimeError("AFD: the checkpoint's config.json names no architecture")
    hf.architectures = [a if a.startswith("AFD") else "AFD" + a for a in original]
    try:
        yield
    except Exception as exc:
        if "not supported" in str(exc) or "failed to be inspected" in str(exc):
            rec = records().get(STEP_MODELS)
            raise RuntimeError(
                f"AFD: no AFD wrapper for architecture {original[0]!r} ({exc}); AFD supports "
                "DeepseekForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, "
                "Qwen3MoeForCausalLM" + (f"; model registration: {rec.status.value}" if rec else "")
            ) from exc
        raise
    finally:
        hf.architectures = original


def make_wire_spec(vllm_config, model) -> WireSpec:
    mc = vllm_config.model_config
    return WireSpec(
        hidden_size=mc.hf_text_config.hidden_size,
        dtype=torch_dtype_name(mc.dtype),
        num_exchange_layers=len(model.ffn_layer_indices()),
        max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
    )


class _Role:
    """This worker's AFD config, rank and connector."""

    def __init__(self, vllm_config, tp_rank: int):
        self.vllm_config = vllm_config
        self.config = require_afd_config(vllm_config)
        assert_steps_ok_for(self.config)
        self.rank = role_rank(vllm_config, tp_rank)
        self.connector: AFDConnector | None = None

    def _connect(self, model) -> None:
        wire = make_wire_spec(self.vllm_config, model)
        self.connector = build_connector(self.config, self.rank, wire)
        self.connector.init()


class AttentionRole(_Role):
    _hook = None

    def attach(self, model) -> None:
        """Connect to the FFN rank and start announcing every forward of `model`."""
        self._connect(model)
        install_connector(self.connector)
        self._hook = model.register_forward_pre_hook(self._announce_step, with_kwargs=True)

    def _announce_step(self, module, args, kwargs):
        positions = kwargs.get("positions")
        if positions is None and len(args) > 1:
            positions = args[1]
        self.connector.send_control((int(positions.shape[-1]),))
        return None

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.connector is not None:
            install_connector(None)
            self.connector.close()


class FFNRole(_Role):
    """Serves the FFN half of every layer for this rank's attention peers."""

    def __init__(self, vllm_config, tp_rank: int):
        super().__init__(vllm_config, tp_rank)
        self.steps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, model, forward_context: Callable[[], contextlib.AbstractContextManager]):
        self.model = model
        self.layers = model.ffn_layer_indices()
        self.forward_context = forward_context
        self._connect(model)

    def serve_step(self) -> bool:
        """One step for all peers; False when every peer has left."""
        import torch

        messages = self.connector.recv_control()
        if self.connector.all_peers_left:
            return False
        live = [m for m in messages if not m.is_shutdown]
        if not live:
            return True
        n_mb = live[0].num_microbatches
        with torch.inference_mode(), self.forward_context():
            for layer in self.layers:
                for mb in range(n_mb):
                    batch = self.connector.recv_attn_output(layer, mb)
                    if batch.hidden_states.shape[0]:
                        out = self.model.compute_ffn_output(layer, batch.hidden_states)
                    else:
                        out = batch.hidden_states
                    self.connector.send_ffn_output(out, layer, mb)
        self.steps += 1
        return True

    def start(self, on_fatal: Callable[[BaseException | None], None]) -> None:
        def loop():
            try:
                while not self._stop.is_set():
                    if not self.serve_step():
                        logger.warning(
                            "AFD FFN rank %d: every attention peer left the deployment after %d "
                            "steps; this FFN server stops (restart the deployment to serve again)",
                            self.rank,
                            self.steps,
                        )
                        on_fatal(None)
                        return
            except BaseException as exc:  # noqa: BLE001 - reported, then the process stops
                if self._stop.is_set():
                    return
                logger.error(
                    "AFD FFN rank %d stopped: %s",
                    self.rank,
                    exc,
                    exc_info=not isinstance(exc, AFDPeerError),
                )
                on_fatal(exc)

        self._thread = threading.Thread(target=loop, name=f"afd-ffn-{self.rank}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self.connector is not None:
            self.connector.close()


def terminate_this_process(exc: BaseException | None) -> None:
    """Stop the worker process so vLLM's executor monitor takes the engine (and the API
    server) down with a clear log line: a dead FFN rank must not look like an idle one."""
    time.sleep(0.1)  # let the log line flush
    os.kill(os.getpid(), signal.SIGTERM)
