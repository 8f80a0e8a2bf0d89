"""Which attention rank takes a request: the frontend's routing policy.

`least-tokens`: the rank with the least outstanding work, a request weighing its prompt plus its
token budget (capped). `prefix`: the same, less the prompt tokens the rank holds cached, so that
a request goes where its prefix is, unless that rank's queue is longer than the tokens the hit
saves: a rank that holds a popular system prompt takes its requests only until its outstanding
work exceeds another rank's by that prompt's length; the next one goes elsewhere and that rank
caches the prompt too. A request routed with a hit also weighs only its uncached tokens.

What each rank holds is the frontend's own mirror of the prompts it routed there (full blocks'
chained hashes, engine/prefix_hash.py, least recently used first, as many as the rank has blocks),
not a report from the ranks: the frontend routes every request, so it has seen every prompt a rank
cached, and a report of hashes and evictions would ride the rank's output message every step. The
mirror is approximate where a rank evicts in another order (its blocks are reference counted, and
hold generated tokens too); a wrong guess costs a cache miss, never a wrong token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from afdserve.config import ROUTING_POLICIES
from afdserve.engine.prefix_hash import prefix_hashes


class PrefixMirror:
    """The chained block hashes one rank is believed to cache, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        count = 0
        for digest in hashes:
            if digest not in self._hashes:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[bytes]) -> None:
        for digest in hashes:
            self._hashes[digest] = None
            self._hashes.move_to_end(digest)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._hashes)


class Router:
    """`capacities`: the KV blocks of each attention rank; `block_size` their tokens per block.
    `prefix` routing needs ranks that cache prefixes; without, it is `least-tokens`."""

    def __init__(
        self, policy: str, capacities: Sequence[int], block_size: int, prefix_caching: bool
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy={policy!r}: must be one of {ROUTING_POLICIES}")
        self.policy = policy if prefix_caching else "least-tokens"
        self.block_size = block_size
        self.outstanding = [0] * len(capacities)
        self.mirrors = [PrefixMirror(c) for c in capacities]

    def route(self, prompt: Sequence[int], budget: int) -> tuple[int, int]:
        """(rank, cost): where a prompt with `budget` new tokens goes and what it weighs there;
        the cost is added to the rank's outstanding work until `release`."""
        ranks = range(len(self.outstanding))
        if self.policy == "least-tokens":
            rank = min(ranks, key=lambda r: (self.outstanding[r], r))
            cost = len(prompt) + budget
        else:
            hashes = prefix_hashes(prompt, self.block_size)
            # Blocks a rank can serve from cache: never the one holding the last prompt token.
            lookup = hashes[: (len(prompt) - 1) // self.block_size]
            cached = [self.mirrors[r].matched_blocks(lookup) * self.block_size for r in ranks]
            rank = min(ranks, key=lambda r: (self.outstanding[r] - cached[r], r))
            cost = len(prompt) - cached[rank] + budget
            self.mirrors[rank].add(hashes)
        self.outstanding[rank] += cost
        return rank, cost

    def release(self, rank: int, cost: int) -> None:
        self.outstanding[rank] -= cost
