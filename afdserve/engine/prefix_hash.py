"""The identity of a full KV-cache block for prefix caching: a hash chained over every token
before and in it, so two blocks share a hash only when everything their KV depends on is equal.

The KV of position p depends on tokens [0, p] and on nothing else for every family with a plain
paged cache (no per-request model inputs change it today); `extra` is where such an input would
enter the chain. The frontend's router (frontend/routing.py) hashes prompts with this same
function to guess which attention rank holds a prefix, so both must agree byte for byte.

SHA-256 rather than Python's `hash`: a server shares its cache between clients, and a collision an
attacker can craft (tuple hashes are not cryptographic) would hand one client another's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = b""  # the parent of a sequence's first block


def block_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """The hash of a block holding `tokens`, after the blocks whose chain ends in `parent`."""
    digest = hashlib.sha256(parent)
    digest.update(len(extra).to_bytes(4, "little"))
    digest.update(extra)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, num_blocks: int | None = None, extra: bytes = b""
) -> list[bytes]:
    """Chained hashes of the first `num_blocks` full blocks of `token_ids` (all full ones when
    None)."""
    full = len(token_ids) // block_size
    count = full if num_blocks is None else min(num_blocks, full)
    out: list[bytes] = []
    parent = ROOT
    for i in range(count):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out
