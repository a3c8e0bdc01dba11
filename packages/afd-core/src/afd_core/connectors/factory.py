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
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        package = module.split(".")[0]
        if exc.name != package:
            raise
        extra = {"afd_npu": "npu"}.get(package, package)
        raise ModuleNotFoundError(
            f"connector {spec.name!r} lives in {package.replace('_', '-')}, which is not "
            f"installed: pip install 'afd-plugin[{extra}]'",
            name=package,
        ) from None
    return getattr(imported, cls)(config, role_rank, wire)
