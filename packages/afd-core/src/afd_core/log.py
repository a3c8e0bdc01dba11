"""AFD loggers live under vLLM's `vllm` logger, so inside vLLM processes their lines get
vLLM's format, level and process prefix; without vLLM they are plain stdlib loggers."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.{name}")
