from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afdserve.layout.topology import Topology


@pytest.mark.parametrize(
    ("text", "attention_ranks", "ffn_ranks", "canonical"),
    [
        ("colocated", 1, 0, "colocated"),
        ("COLOCATED", 1, 0, "colocated"),
        ("1A0F", 1, 0, "colocated"),
        ("2A0F", 2, 0, "2A0F"),
        ("2A1F", 2, 1, "2A1F"),
        ("4a2f", 4, 2, "4A2F"),
        ("3A2F", 3, 2, "3A2F"),
        (" 8A8F ", 8, 8, "8A8F"),
    ],
)
def test_parse_and_str(text: str, attention_ranks: int, ffn_ranks: int, canonical: str) -> None:
    topology = Topology.parse(text)
    assert topology == Topology(attention_ranks, ffn_ranks)
    assert str(topology) == canonical
    assert Topology.parse(str(topology)) == topology


@settings(max_examples=300, deadline=None, database=None)
@given(st.integers(1, 64).flatmap(lambda a: st.tuples(st.just(a), st.integers(0, a))))
def test_round_trip_and_peers_partition(shape: tuple[int, int]) -> None:
    attention_ranks, ffn_ranks = shape
    topology = Topology(attention_ranks, ffn_ranks)
    assert Topology.parse(str(topology)) == topology
    assert Topology.parse(str(topology).lower()) == topology
    assert topology.world_size == attention_ranks + ffn_ranks
    assert topology.colocated == (ffn_ranks == 0)
    served = [rank for f in range(ffn_ranks) for rank in topology.peers(f)]
    if topology.colocated:
        assert served == []
        assert all(topology.ffn_rank_of(r) is None for r in range(attention_ranks))
        return
    assert sorted(served) == list(range(attention_ranks))
    for f in range(ffn_ranks):
        peers = topology.peers(f)
        assert peers and list(peers) == sorted(peers)
        assert all(topology.ffn_index(topology.ffn_rank_of(r)) == f for r in peers)
        # Strided assignment keeps the peer counts within one of each other.
        assert len(peers) in (attention_ranks // ffn_ranks, -(-attention_ranks // ffn_ranks))


def test_roles_and_peers_divisible() -> None:
    topology = Topology.parse("4A2F")
    assert [topology.is_attention(rank) for rank in range(6)] == [True] * 4 + [False] * 2
    assert topology.peers(0) == (0, 2)
    assert topology.peers(1) == (1, 3)
    assert [topology.ffn_rank_of(r) for r in range(4)] == [4, 5, 4, 5]
    assert topology.ffn_index(4) == 0
    assert topology.ffn_index(5) == 1


def test_peers_non_divisible() -> None:
    topology = Topology.parse("3A2F")
    assert topology.peers(0) == (0, 2)
    assert topology.peers(1) == (1,)
    assert [topology.ffn_rank_of(r) for r in range(3)] == [3, 4, 3]
    five_three = Topology.parse("5A3F")
    assert [five_three.peers(f) for f in range(3)] == [(0, 3), (1, 4), (2,)]


def test_colocated_has_no_ffn_ranks() -> None:
    topology = Topology.parse("colocated")
    assert topology.colocated
    assert topology.world_size == 1
    assert topology.is_attention(0)
    assert topology.ffn_rank_of(0) is None
    with pytest.raises(ValueError, match="FFN index 0 is out of range"):
        topology.peers(0)


@pytest.mark.parametrize("text", ["2A", "AF", "2F1A", "A1F", "2A1", "", "2A 1F", "two"])
def test_parse_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError, match=rf"topology '{text}' is not understood.*'colocated'"):
        Topology.parse(text)


@pytest.mark.parametrize("text", ["0A1F", "0A0F", "-1A1F"])
def test_parse_rejects_missing_attention_ranks(text: str) -> None:
    with pytest.raises(ValueError, match=rf"topology '{text}'.*A >= F >= 1"):
        Topology.parse(text)
    if text == "0A1F":
        with pytest.raises(ValueError, match="attention_ranks must be >= 1, got 0"):
            Topology.parse(text)


def test_fewer_attention_than_ffn_ranks_states_the_rule() -> None:
    rule = r"r mod F == f.*at least one attention peer.*expert-parallel FFN group"
    with pytest.raises(ValueError, match=r"topology '1A2F'.*" + rule + r".*--ffn-expert-parallel"):
        Topology.parse("1A2F")
    with pytest.raises(ValueError, match=r"ffn_ranks \(3\) must not exceed attention_ranks \(2\)"):
        Topology(attention_ranks=2, ffn_ranks=3)


def test_expert_parallel_allows_fewer_attention_ranks() -> None:
    topology = Topology.parse("2A4F", expert_parallel=True)
    assert topology == Topology(2, 4, expert_parallel=True)
    assert topology.ffn_group == (2, 3, 4, 5)
    assert [topology.peers(f) for f in range(4)] == [(0,), (1,), (), ()]
    assert [topology.ffn_rank_of(r) for r in range(2)] == [2, 3]
    assert Topology.parse("4A2F", expert_parallel=True).ffn_group == (4, 5)
    assert Topology(4, 2).ffn_group == ()
    with pytest.raises(ValueError, match="expert_parallel=True needs ffn_ranks >= 1"):
        Topology(2, 0, expert_parallel=True)
    with pytest.raises(ValueError, match="'colocated': an expert-parallel FFN group needs FFN"):
        Topology.parse("colocated", expert_parallel=True)
    with pytest.raises(ValueError, match="expert_parallel must be a bool, got 1"):
        Topology(2, 2, expert_parallel=1)


@pytest.mark.parametrize(
    ("attention_ranks", "ffn_ranks", "message"),
    [
        (0, 0, "attention_ranks must be >= 1, got 0"),
        (2, -1, "ffn_ranks must be >= 0"),
        (True, 0, "attention_ranks must be an int, got True"),
        (2, 1.0, "ffn_ranks must be an int, got 1.0"),
    ],
)
def test_constructor_validates(attention_ranks: int, ffn_ranks: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Topology(attention_ranks, ffn_ranks)


def test_rank_queries_reject_out_of_range() -> None:
    topology = Topology.parse("3A2F")
    with pytest.raises(ValueError, match=r"rank 5 is out of range for 3A2F; allowed \[0, 5\)"):
        topology.is_attention(5)
    with pytest.raises(ValueError, match=r"rank 2 is not an FFN rank of 3A2F.*\[3, 5\)"):
        topology.ffn_index(2)
    with pytest.raises(ValueError, match=r"attention_rank 3 is out of range"):
        topology.ffn_rank_of(3)
    with pytest.raises(ValueError, match=r"FFN index 2 is out of range for 3A2F"):
        topology.peers(2)
