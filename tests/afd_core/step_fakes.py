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
        from afd_core.connectors.control import ControlMessage

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
