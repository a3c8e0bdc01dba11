"""Connector `hccl`: the shared device transport and the whole step protocol, with the HCCL
process group swapped for gloo (one tag, so operations match in issue order as on HCCL) and
the NPU runtime for host streams (tests/afd_core/nccl_standin.py), in real processes."""

from __future__ import annotations

import pytest

from tests.afd_core import test_ffn_loss as ffn_loss
from tests.afd_core import test_peer_loss as peer_loss
from tests.afd_core import test_step_protocol as step_protocol

pytestmark = pytest.mark.vllm  # needs torch (the CPU build comes with vLLM)


@pytest.fixture
def over_hccl(monkeypatch):
    """Spawned test processes build the HCCL connector over the stand-ins."""
    monkeypatch.setenv("AFD_TEST_CONNECTOR", "hccl")


def test_micro_batches_and_shapes_over_hccl(over_hccl):
    """Peers with different m and zero-row micro-batches (the 4A2F shape runs over the same
    device transport in tests/afd_core/test_nccl_transport.py)."""
    steps = {0: [(3, 4), (2,), (1, 1, 1, 1)], 1: [(1, 1, 1, 1), (0, 5, 0), (6,)]}
    step_protocol.test_microbatches_every_m_and_shape(2, 1, steps)


def test_a_crashed_attention_server_is_dropped_and_its_restart_rejoins_over_hccl(
    tmp_path, monkeypatch
):
    """Recovery over the device transport as HCCL drives it (the NCCL stand-in runs the
    same cases in tests/afd_core): the lost server's link aborted alone, the other served,
    a fresh link for the restart."""
    peer_loss.test_a_lost_attention_server_is_dropped_the_other_served_and_its_restart_rejoins(
        (3, 0), "hccl", tmp_path, monkeypatch
    )


def test_the_attention_servers_outlive_a_crashed_ffn_server_over_hccl(tmp_path, monkeypatch):
    ffn_loss.test_the_attention_servers_outlive_their_ffn_server_and_are_served_again(
        "crash", "hccl", tmp_path, monkeypatch
    )


def test_the_connector_is_registered_for_npu_only():
    from afd_core.config import parse_afd_config
    from afd_core.connectors.registry import connector_spec, default_connector_for

    spec = connector_spec("hccl")
    assert spec.device_types == ("npu",)
    assert spec.target == "afd_npu.connectors.hccl:HcclConnector"
    assert default_connector_for("npu") == "hccl"
    with pytest.raises(Exception, match="connector='hccl' runs on npu"):
        parse_afd_config({"role": "ffn", "connector": "hccl"}, device_type="cpu")


def test_each_communicator_is_a_process_group_of_its_own_on_afds_store():
    """HcclFactory: a fresh store prefix per communicator (never a group vLLM-Ascend's
    registry could share); operations run on the given stream and wait there."""
    from afd_npu.connectors.hccl import HcclFactory

    made = []

    class Backend:
        def __init__(self, store, rank, size, timeout_s, name):
            made.append((rank, size, timeout_s, name))
            self.ops = []

        def send(self, tensors, peer, tag):
            self.ops.append(("send", peer, tag))
            return _Done()

        def recv(self, tensors, peer, tag):
            self.ops.append(("recv", peer, tag))
            return _Done()

    class Runtime:
        ran_on = []

        def run_on(self, stream, fn):
            self.ran_on.append(stream)
            fn()

    import torch.distributed as dist

    store = dist.HashStore()
    factory = HcclFactory(Runtime(), 42.0, Backend)
    a, b = factory.unique_id(), factory.unique_id()
    assert a != b
    comm = factory.connect(a, 1, 3, None, store)
    factory.connect(b, 1, 3, None, store)
    assert [m[:3] for m in made] == [(1, 3, 42.0), (1, 3, 42.0)]
    assert made[0][3] != made[1][3] and made[0][3].startswith("afd-hccl/")
    comm.send("t", 0, "s1")
    comm.recv("t", 0, "s2")
    assert comm._backend.ops == [("send", 0, 0), ("recv", 0, 0)]
    assert Runtime.ran_on == ["s1", "s2"]


class _Done:
    def wait(self):
        return True
