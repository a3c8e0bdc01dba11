"""Every connector AFD knows, by the name used in the config (no torch imported here)."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from afd_core.connectors.options import GlooOptions, HcclOptions, NcclOptions
from afd_core.errors import AFDConfigError
from afd_core.topology import validate_point_to_point

if TYPE_CHECKING:
    from afd_core.config import AFDConfig


def _no_extra_rules(config: AFDConfig) -> None:
    return None


@dataclass(frozen=True)
class ConnectorSpec:
    name: str
    target: str  # "module:Class", imported only when the connector is built
    device_types: tuple[str, ...]  # vLLM platform device types it runs on
    description: str
    options: type[BaseModel]
    validate_topology: Callable[[int, int], None] = validate_point_to_point
    extra_rules: Callable[[AFDConfig], None] = field(default=_no_extra_rules)

    def parse_extra(self, raw: Any) -> BaseModel:
        if not isinstance(raw, dict):
            raise AFDConfigError(
                f"afd config: connector_extra_config={raw!r} is invalid: expected a JSON "
                f"object of {self.name!r} options ({', '.join(self.options.model_fields)})",
                "connector_extra_config",
                raw,
            )
        try:
            return self.options.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = str(err["loc"][0]) if err["loc"] else ""
            allowed = ", ".join(self.options.model_fields)
            if err["type"] == "extra_forbidden":
                close = difflib.get_close_matches(key, self.options.model_fields, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                msg = (
                    f"unknown option {key!r} for connector {self.name!r}.{hint} Allowed: {allowed}"
                )
            else:
                msg = (
                    f"{key}={raw.get(key)!r} is invalid for connector {self.name!r}: "
                    f"{err['msg'].removeprefix('Value error, ')}"
                )
            raise AFDConfigError(
                f"afd config: connector_extra_config.{msg}"
                if not msg.startswith("unknown")
                else f"afd config: connector_extra_config: {msg}",
                f"connector_extra_config.{key}",
                raw.get(key),
            ) from None

    def validate_config(self, config: AFDConfig) -> None:
        self.extra_rules(config)


# Every connector here allows afd.async_dp: the protocol logic they share assembles each FFN
# step from whichever peers announced one (protocol/ffn_assembly.py), waiting only for the
# ranks that step together with those (one lockstep attention server, or one DP rank's TP
# ranks), and each transport matches operations per peer pair, so peers that step on their
# own never wait for each other. An FFN expert group cannot serve them (start-up check_peers).


_SPECS: dict[str, ConnectorSpec] = {
    "gloo": ConnectorSpec(
        name="gloo",
        target="afd_core.connectors.gloo:GlooConnector",
        device_types=("cpu",),
        description="CPU tensors over torch.distributed gloo (TCP), AFD's own process groups",
        options=GlooOptions,
    ),
    "nccl": ConnectorSpec(
        name="nccl",
        target="afd_core.connectors.nccl:NcclConnector",
        device_types=("cuda",),
        description="CUDA tensors over NCCL point-to-point (vLLM's PyNccl), one communicator "
        "per direction; control on a CPU gloo channel",
        options=NcclOptions,
    ),
    "hccl": ConnectorSpec(
        name="hccl",
        # in afd-npu (pip install "afd-plugin[npu]"): afd-core imports nothing of Ascend's
        target="afd_npu.connectors.hccl:HcclConnector",
        device_types=("npu",),
        description="Ascend NPU tensors over HCCL point-to-point (torch_npu's "
        "ProcessGroupHCCL), one communicator per direction; control on a CPU gloo channel",
        options=HcclOptions,
    ),
}


def available_connectors() -> list[str]:
    return list(_SPECS)


def connector_spec(name: str) -> ConnectorSpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise AFDConfigError(
            f"afd config: connector={name!r} is unknown; allowed: {', '.join(_SPECS)}",
            "connector",
            name,
        ) from None


def default_connector_for(device_type: str) -> str:
    for spec in _SPECS.values():
        if device_type in spec.device_types:
            return spec.name
    raise AFDConfigError(
        f"afd config: no connector given and none is available yet for platform "
        f"{device_type!r}; available connectors: "
        + ", ".join(f"{s.name} ({'/'.join(s.device_types)})" for s in _SPECS.values()),
        "connector",
        None,
    )
