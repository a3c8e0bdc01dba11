"""Connector `gloo`: the point-to-point AFD protocol (`p2p.py`) over the CPU gloo transport
(`transports/gloo.py`)."""

from __future__ import annotations

from afd_core.connectors.p2p import PointToPointConnector
from afd_core.connectors.transports.gloo import GlooTransport
from afd_core.connectors.transports.transport import Transport


class GlooConnector(PointToPointConnector):
    """Connector `gloo`: the point-to-point AFD protocol over GlooTransport (CPU tensors)."""

    # each attention rank has a link of its own with the FFN rank: a lost one fails alone,
    # and a restarted attention server gets a fresh one
    survives_peer_loss = True

    def new_transport(self, *args, **kwargs) -> Transport:
        return GlooTransport(*args, **kwargs)

    def make_transport(self, group: int, group_rank: int, group_size: int) -> Transport:
        transport = super().make_transport(group, group_rank, group_size)
        transport.per_member_links = True
        return transport

    def check_tensor(self, tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"connector 'gloo' moves CPU tensors only, got a tensor on {tensor.device}"
            )
