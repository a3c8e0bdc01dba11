"""Build the connector a config names."""

from __future__ import annotations

import importlib

from afd_core.config import AFDConfig
from afd_core.connectors.base import AFDConnector, WireSpec
from afd_core.connectors.registry import connector_spec


def build_connector(config: AFDConfig, role_rank: int, wire: WireSpec) -> AFDConnector:
    """Construct (not yet connect) the connector; validates the rank against the topology."""
    spec = connector_spec(config.connector)
    module, cls = spec.target.split(":")
    connector_cls = getattr(importlib.import_module(module), cls)
    return connector_cls(config, role_rank, wire)
