"""The CPU transport: the rendezvous store and control channel every transport shares
(`rendezvous.py`), and a data channel of torch.distributed gloo over TCP, in process groups
of AFD's own.

Each FFN rank k and its attention peers form one group (FFN rank at group rank 0); its
`data` gloo group has the step timeout (a gloo timeout closes the pair, so it is fatal, as
a lost peer mid-step is). vLLM's own process groups are never touched. Both groups connect
a pair at its first operation (`gloo_group`): each attention rank holds one pair per group,
to its FFN rank, instead of one to every member.
"""

from __future__ import annotations

import datetime

from afd_core.connectors.p2p import PointToPointConnector
from afd_core.connectors.rendezvous import StoreTransport, gloo_group
from afd_core.connectors.transport import Handle, Transport


class GlooTransport(StoreTransport):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._data = None

    def _connect_data(self, prefix: str) -> None:
        import torch.distributed as dist

        self._data = gloo_group(
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

    # each attention rank has pairs of its own with the FFN rank: a lost one fails alone
    survives_peer_loss = True

    def new_transport(self, *args, **kwargs) -> Transport:
        return GlooTransport(*args, **kwargs)

    def check_tensor(self, tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"connector 'gloo' moves CPU tensors only, got a tensor on {tensor.device}"
            )
