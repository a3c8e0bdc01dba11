import pytest

from afd_core.topology import Topology, TopologyError


@pytest.mark.parametrize(
    "a,f,peers",
    [
        (1, 1, {0: [0]}),
        (2, 1, {0: [0, 1]}),
        (4, 2, {0: [0, 1], 1: [2, 3]}),
        (2, 2, {0: [0], 1: [1]}),
        # any A >= F: contiguous blocks, sizes differing by at most one, the larger first
        (3, 2, {0: [0, 1], 1: [2]}),
        (5, 2, {0: [0, 1, 2], 1: [3, 4]}),
        (7, 3, {0: [0, 1, 2], 1: [3, 4], 2: [5, 6]}),
        (5, 4, {0: [0, 1], 1: [2], 2: [3], 3: [4]}),
        (6, 4, {0: [0, 1], 1: [2, 3], 2: [4], 3: [5]}),
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


@pytest.mark.parametrize("a", range(1, 40))
@pytest.mark.parametrize("f", range(1, 12))
def test_every_shape_a_ge_f_is_blocks_differing_by_at_most_one(a, f):
    if a < f:
        with pytest.raises(TopologyError, match="A >= F"):
            Topology(a, f)
        return
    t = Topology(a, f)
    blocks = [t.peers_of(k) for k in range(f)]
    assert [p for b in blocks for p in b] == list(range(a))  # contiguous, in rank order
    sizes = [len(b) for b in blocks]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert all(t.ffn_rank_of(p) == k for k, b in enumerate(blocks) for p in b)


@pytest.mark.parametrize("a,f", [(1, 2), (0, 1), (1, 0), (4, 6)])
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
