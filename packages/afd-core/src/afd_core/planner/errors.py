"""The planner's one error type: a bad model, hardware or target input."""

from __future__ import annotations


class PlanInputError(ValueError):
    """A planner input is missing or out of range; the message names the field, the value
    and what is allowed."""
