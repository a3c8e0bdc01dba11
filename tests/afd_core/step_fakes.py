"""An in-memory stand-in for the attention side's connector: records the step protocol
calls, and the "FFN" doubles the rows (tests of the step wrapper and of vLLM's
micro-batching)."""

from __future__ import annotations


class FakeExchange:
    def __init__(self, h):
        self.h = h

    def wait(self):
        return self.h * 2  # the "FFN"


class FakeConnector:
    role_rank = 0

    def __init__(self):
        self.steps, self.exchanges, self.aborted, self.ended, self.replayed = [], [], 0, 0, 0

    def begin_step(self, rows, flags=0):
        from afd_core.connectors.protocol.control import ControlMessage

        self.steps.append((tuple(rows), int(flags)))
        return ControlMessage(0, len(self.steps) - 1, tuple(rows), 8, "float32")

    def start_exchange(self, h, layer, microbatch=0, router_logits=None, token_ids=None):
        self.exchanges.append((layer, microbatch, h.shape[0]))
        return FakeExchange(h.clone())

    def end_step(self):
        self.ended += 1

    def mark_exchanged(self):
        self.replayed += 1

    def abort_step(self):
        self.aborted += 1
        return "micro-batch 1 at layer 0"


def recording_kv_connector(calls: list, finished=(None, None)):
    """A vLLM v1 KV connector (what `get_kv_transfer_group()` returns in a worker) that
    records its worker-side calls in `calls`: per-layer hooks with the micro-batch they ran
    in and the attention metadata they were given; `get_finished` answers `finished`."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from afd_core.dbo import current_microbatch_id

    class Recording(KVConnectorBase_V1):
        def __init__(self):  # no vLLM config: only the worker-side calls are made
            self._connector_metadata = None

        def start_load_kv(self, forward_context, **kwargs):
            calls.append(("start_load_kv", forward_context))

        def wait_for_layer_load(self, layer_name):
            calls.append(("wait_for_layer_load", current_microbatch_id(), layer_name))

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            calls.append(("save_kv_layer", current_microbatch_id(), layer_name, attn_metadata))

        def wait_for_save(self):
            calls.append(("wait_for_save",))

        def get_finished(self, finished_req_ids):
            calls.append(("get_finished", set(finished_req_ids)))
            return finished

        def clear_connector_metadata(self):
            calls.append(("clear_connector_metadata",))
            super().clear_connector_metadata()

        # scheduler side: not called in a worker
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            raise NotImplementedError

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            raise NotImplementedError

        def build_connector_meta(self, scheduler_output):
            raise NotImplementedError

    return Recording()
