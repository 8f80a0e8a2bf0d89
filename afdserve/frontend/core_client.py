"""EngineCoreClient (vLLM's name): the frontend's handle on the engine core, whatever the topology:
one process (frontend/single_process.py) or a world of rank processes (frontend/process.py).
Its step() returns token deltas only; the frontend's EngineClient (frontend/client.py) turns them
into outputs.

Not thread-safe: one thread owns a client.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from afdserve.engine.requests import RequestLimits, TokenDelta
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.speculative import SpecStats


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, averaged over attention ranks
    steps: dict[str, int] = field(default_factory=dict)  # "role:mode" -> count
    # Per attention rank, cumulative: prompt tokens looked up in its prefix cache, and found.
    prefix_cache_queries: dict[int, int] = field(default_factory=dict)
    prefix_cache_hits: dict[int, int] = field(default_factory=dict)
    # Per attention rank, cumulative (RankStats says what each is).
    preemptions: dict[int, int] = field(default_factory=dict)
    scheduled_tokens: dict[int, int] = field(default_factory=dict)
    forward_s: dict[int, float] = field(default_factory=dict)
    wait_s: dict[int, float] = field(default_factory=dict)
    a2e_bytes: dict[int, int] = field(default_factory=dict)
    e2a_bytes: dict[int, int] = field(default_factory=dict)
    # Per FFN rank, cumulative: seconds in its FFN half's steps, of which waiting for tiles,
    # and the real rows it received.
    ffn_forward_s: dict[int, float] = field(default_factory=dict)
    ffn_wait_s: dict[int, float] = field(default_factory=dict)
    ffn_tokens: dict[int, int] = field(default_factory=dict)
    # Every step since start, every attention rank: tokens computed -> how many steps.
    iteration_tokens: dict[int, int] = field(default_factory=dict)
    # Per attention rank, cumulative, with speculative decoding on (vllm:spec_decode_*).
    spec_decode: dict[int, SpecStats] = field(default_factory=dict)
    # vLLM's cache_config_info labels (block_size, num_gpu_blocks, cache_dtype, ...).
    cache_config: dict[str, str] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Hits over queries since start, every rank together; None before any query."""
        queries = sum(self.prefix_cache_queries.values())
        return sum(self.prefix_cache_hits.values()) / queries if queries else None

    @property
    def spec_totals(self) -> tuple[int, int, int]:
        """(accepted draft tokens, draft tokens, sequences verified with drafts) since start,
        every rank together."""
        ranks = self.spec_decode.values()
        return (
            sum(s.num_accepted_tokens for s in ranks),
            sum(s.num_draft_tokens for s in ranks),
            sum(s.num_drafts for s in ranks),
        )


def cache_config_labels(limits: RequestLimits, cache_dtype: str, prefix_caching: bool) -> dict:
    """vLLM's vllm:cache_config_info labels: the KV block size, the blocks one attention rank
    holds (the smallest rank's), the cache dtype and whether prefixes are cached."""
    return {
        "block_size": str(limits.block_size),
        "num_gpu_blocks": str(limits.num_blocks),
        "cache_dtype": cache_dtype,
        "enable_prefix_caching": str(prefix_caching),
    }


class EngineCoreClient(ABC):
    max_model_len: int
    vocab_size: int
    limits: RequestLimits  # what every attention rank can hold (the smallest of them)
    repairable: bool = False  # `repair` may rebuild it after a failure

    @abstractmethod
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        """Raises RequestError for a request the engine refuses; others are unaffected.
        `output_token_ids`: the tokens a resumed request had generated on a failed engine; it
        continues after them (its deltas count them, and carry only what is new)."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop the request and free its KV blocks; deltas already on their way may follow."""

    @abstractmethod
    def step(self) -> list[TokenDelta]:
        """Advance the engine; returns the requests that changed. Returns [] promptly when idle."""

    @property
    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def stats(self) -> EngineStats: ...

    def step_log(self) -> list[dict]:
        return []

    def wake(self) -> None:
        """From any thread, once a request or abort is queued for the thread that steps: a
        client whose `step` waits on its ranks returns early, so the queue is read at once."""
        return None

    def repair(self) -> bool:
        """After `step` raised for a failed rank: rebuild the engine around what survived (only
        the failed ranks reload their weights), dropping every request (the caller resumes
        them). False where this client cannot, or could not: the caller restarts it whole."""
        return False

    def shutdown(self) -> None:
        return None
