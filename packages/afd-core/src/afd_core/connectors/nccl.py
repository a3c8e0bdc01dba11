"""Connector `nccl`: the point-to-point AFD protocol over NCCL (`transports/nccl.py`), as
every accelerator's connector is (`device_connector.py`)."""

from __future__ import annotations

from afd_core.connectors.device_connector import DeviceConnector
from afd_core.connectors.transports.device import CudaRuntime, DeviceRuntime
from afd_core.connectors.transports.device_transport import CommFactory
from afd_core.connectors.transports.nccl import PyNcclFactory


class NcclConnector(DeviceConnector):
    """Connector `nccl`: the point-to-point AFD protocol over NCCL (CUDA tensors); control
    on a CPU gloo channel."""

    name = "nccl"
    channel = "NCCL"

    def default_runtime(self) -> DeviceRuntime:
        import torch

        return CudaRuntime(torch.device("cuda", torch.cuda.current_device()))

    def default_comm_factory(self) -> CommFactory:
        return PyNcclFactory()
