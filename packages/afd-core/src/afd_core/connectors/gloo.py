"""The CPU transport: the rendezvous store and control channel every transport shares
(`rendezvous.py`), and a data channel of torch.distributed gloo over TCP, in process groups
of AFD's own.

Each FFN rank k and its attention peers form one group (FFN rank at group rank 0); its
`data` gloo group has the step timeout (a gloo timeout closes the pair, so it is fatal, as
a lost peer mid-step is). vLLM's own process groups are never touched.
"""

from __future__ import annotations

import datetime

from afd_core.connectors.p2p import PointToPointConnector
from afd_core.connectors.rendezvous import StoreTransport
from afd_core.connectors.transport import Handle, Transport


class GlooTransport(StoreTransport):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._data = None

    def _connect_data(self, prefix: str) -> None:
        import torch.distributed as dist

        self._data = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix + "/data", self._store),
            self.group_rank,
            self.group_size,
            datetime.timedelta(seconds=self.timeout_s),
        )

    def close(self) -> None:
        self._data = None
        super().close()

    def isend(self, tensor, peer: int, tag: int) -> Handle:
        return self._handle(lambda: self._data.send([tensor], peer, tag), "send")

    def irecv(self, tensor, peer: int, tag: int) -> Handle:
        return self._handle(lambda: self._data.recv([tensor], peer, tag), "receive")


class GlooConnector(PointToPointConnector):
    """Connector `gloo`: the point-to-point AFD protocol over GlooTransport (CPU tensors)."""

    def make_transport(self, group: int, group_rank: int, group_size: int) -> Transport:
        return self._gloo_transport(
            group, group_rank, group_size, self.config.is_ffn and self.role_rank == 0, 1.0
        )

    def make_side_transport(
        self, name: str, group_rank: int, group_size: int, connect_scale: float
    ) -> Transport:
        return self._gloo_transport(name, group_rank, group_size, False, connect_scale)

    def _gloo_transport(self, group, group_rank, group_size, store_master, connect_scale):
        extra = self.config.extra()
        return GlooTransport(
            self.config.host,
            self.config.port,
            group,
            group_rank,
            group_size,
            is_store_master=store_master,
            timeout_s=extra.timeout_s,
            connect_timeout_s=extra.connect_timeout_s * connect_scale,
        )

    def check_tensor(self, tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"connector 'gloo' moves CPU tensors only, got a tensor on {tensor.device}"
            )
