"""Process-local AFD state shared by a role worker and the model it runs.

The attention worker installs its connector here (and, over tensor parallel, its TP rank's
sequence split); the model's FFN proxies (built inside vLLM's model loader, which knows
nothing of AFD) find them here at forward time.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from afd_core.connectors.base import AFDConnector
    from afd_core.step.sequence_split import SequenceSplit

_lock = threading.Lock()
_connector: AFDConnector | None = None
_split: SequenceSplit | None = None


def install_connector(connector: AFDConnector | None) -> None:
    global _connector
    with _lock:
        _connector = connector


def active_connector() -> AFDConnector:
    conn = _connector
    if conn is None:
        raise RuntimeError(
            "AFD: no connector is installed in this process; an AFD model ran outside an AFD "
            "worker (start vLLM with --additional-config '{\"afd\": {...}}' and worker class auto)"
        )
    return conn


def install_sequence_split(split: SequenceSplit | None) -> None:
    global _split
    with _lock:
        _split = split


def active_sequence_split() -> SequenceSplit | None:
    """This attention TP rank's share of the rows; None without tensor parallelism."""
    return _split
