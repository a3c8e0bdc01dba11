"""Errors shared by the config schema and the connector registry (which the schema uses):
here, so that neither imports the other for them."""

from __future__ import annotations

from typing import Any


class AFDConfigError(ValueError):
    """A bad `afd` config: names the field, the value and what is allowed."""

    def __init__(self, message: str, field: str | None = None, value: Any = None):
        super().__init__(message)
        self.field = field
        self.value = value
