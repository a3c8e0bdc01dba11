"""The point-to-point AFD protocol (`p2p.py`) over a device transport
(`transports/device_transport.py`), for every accelerator: a platform's connector (`nccl.py`
here, `afd_npu/connectors/hccl.py`) gives its runtime and communicator factory."""

from __future__ import annotations

from abc import abstractmethod

from afd_core.connectors.p2p import PointToPointConnector
from afd_core.connectors.transports.device import DeviceRuntime
from afd_core.connectors.transports.device_transport import CommFactory, DeviceTransport
from afd_core.connectors.transports.transport import Transport


class DeviceConnector(PointToPointConnector):
    """The point-to-point AFD protocol over a DeviceTransport: a platform's connector names
    its channel and gives its default runtime and communicator factory. `runtime` and
    `comm_factory` override them (the tests pass host stand-ins)."""

    name = "device"  # the connector's registry name
    channel = "device"
    fixed_receive_buffers = True  # stable addresses for captured graphs
    # each attention rank has a link of its own with the FFN rank (transports/member_links.py): a
    # lost one is dropped alone, a restarted one rejoins, an FFN restart is resumed
    survives_peer_loss = True

    def __init__(self, config, role_rank: int, wire, runtime=None, comm_factory=None):
        super().__init__(config, role_rank, wire)
        self._runtime = runtime
        self._comm_factory = comm_factory

    @abstractmethod
    def default_runtime(self) -> DeviceRuntime:
        """This process's device (built on first use: a config check touches no device)."""

    @abstractmethod
    def default_comm_factory(self) -> CommFactory: ...

    @property
    def runtime(self) -> DeviceRuntime:
        if self._runtime is None:
            self._runtime = self.default_runtime()
        return self._runtime

    @property
    def comm_factory(self) -> CommFactory:
        if self._comm_factory is None:
            self._comm_factory = self.default_comm_factory()
        return self._comm_factory

    @property
    def device(self):
        return self.runtime.device

    def new_transport(self, *args, **kwargs) -> Transport:
        transport = DeviceTransport(
            *args, runtime=self.runtime, comm_factory=self.comm_factory, **kwargs
        )
        transport.channel = self.channel
        return transport

    def make_transport(self, group: int, group_rank: int, group_size: int) -> Transport:
        transport = super().make_transport(group, group_rank, group_size)
        transport.per_member_links = True  # a lost attention member fails alone
        return transport

    def check_tensor(self, tensor) -> None:
        if tensor.device != self.device:
            raise ValueError(
                f"connector {self.name!r} moves tensors on {self.device}, got a tensor on "
                f"{tensor.device}"
            )
