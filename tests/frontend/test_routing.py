"""The frontend's routing policy (frontend/routing.py) on its own: prefix hits attract a
request, but never flood one rank beyond the tokens a hit saves."""

from __future__ import annotations

import pytest

from afdserve.engine.prefix_hash import prefix_hashes
from afdserve.frontend.routing import PrefixMirror, Router

BS = 4


def test_least_tokens_picks_the_rank_with_least_work() -> None:
    router = Router("least-tokens", [100, 100, 100], BS, prefix_caching=True)
    ranks = [router.route([1] * 10, 5)[0] for _ in range(3)]
    assert ranks == [0, 1, 2]
    assert router.outstanding == [15, 15, 15]
    router.release(1, 15)
    assert router.route([2] * 3, 1) == (1, 4)


def test_prefix_routing_follows_the_cached_prefix() -> None:
    router = Router("prefix", [100, 100], BS, prefix_caching=True)
    system = list(range(40))
    first, cost = router.route(system + [1], 8)
    assert (first, cost) == (0, 49)
    router.release(first, cost)
    # Both idle: the rank holding the 40 cached tokens wins, and the request weighs its rest.
    assert router.route(system + [2, 3], 8) == (0, 2 + 8 + 0)


def test_a_popular_prefix_does_not_flood_its_rank() -> None:
    """Requests sharing a 40-token prefix keep going to the rank that holds it only while its
    queue is within 40 tokens of the other's; then one goes to the other rank, which from then on
    holds the prefix too, and the two share the load."""
    router = Router("prefix", [100, 100], BS, prefix_caching=True)
    system = list(range(40))
    ranks = [router.route(system + [100 + i], 16)[0] for i in range(12)]
    assert ranks[0] == 0 and 1 in ranks
    assert abs(router.outstanding[0] - router.outstanding[1]) <= 40 + 1 + 16
    assert ranks[-4:].count(0) == 2  # both hold it now: they alternate


def test_without_prefix_caching_prefix_is_least_tokens() -> None:
    router = Router("prefix", [100, 100], BS, prefix_caching=False)
    assert router.policy == "least-tokens"
    with pytest.raises(ValueError, match="routing_policy='nearest'"):
        Router("nearest", [1], BS, True)


def test_the_mirror_forgets_the_least_recently_used_beyond_the_rank_blocks() -> None:
    mirror = PrefixMirror(capacity=3)
    a, b = prefix_hashes(list(range(8)), BS), prefix_hashes([9] * 8, BS)
    mirror.add(a)
    assert mirror.matched_blocks(a) == 2
    mirror.add(b)
    assert len(mirror) == 3 and mirror.matched_blocks(b) == 2
    assert mirror.matched_blocks(a) == 0  # its first block went first
