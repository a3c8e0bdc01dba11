import pytest

from afd_core.topology import Topology, TopologyError


@pytest.mark.parametrize(
    "a,f,peers",
    [
        (1, 1, {0: [0]}),
        (2, 1, {0: [0, 1]}),
        (4, 2, {0: [0, 1], 1: [2, 3]}),
        (2, 2, {0: [0], 1: [1]}),
    ],
)
def test_shapes(a, f, peers):
    t = Topology(a, f)
    assert t.world_size == a + f
    assert {k: t.peers_of(k) for k in range(f)} == peers
    for k, ps in peers.items():
        assert t.world_rank("ffn", k) == k
        for p in ps:
            assert t.ffn_rank_of(p) == k
            assert t.world_rank("attention", p) == f + p


@pytest.mark.parametrize("a,f", [(1, 2), (3, 2), (0, 1), (1, 0), (6, 4)])
def test_rejected_shapes(a, f):
    with pytest.raises(TopologyError):
        Topology(a, f)


def test_out_of_range_ranks():
    t = Topology(2, 1)
    with pytest.raises(TopologyError, match="attention rank 2 is out of range; allowed 0..1"):
        t.world_rank("attention", 2)
    with pytest.raises(TopologyError, match="ffn rank 1"):
        t.peers_of(1)
    with pytest.raises(TopologyError, match="role 'x'"):
        t.world_rank("x", 0)
