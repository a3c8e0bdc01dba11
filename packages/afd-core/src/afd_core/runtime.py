"""Process-local AFD state shared by a role worker and the model it runs.

The attention worker installs its connector here; the model's FFN proxies (built inside
vLLM's model loader, which knows nothing of AFD) find it here at forward time.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from afd_core.connectors.base import AFDConnector

_lock = threading.Lock()
_connector: AFDConnector | None = None


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
