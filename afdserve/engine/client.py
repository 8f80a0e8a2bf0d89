"""EngineClient: the one interface the offline API and the HTTP server drive, whatever the topology.

Not thread-safe: one thread owns a client (the server funnels requests through its engine thread).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from afdserve.engine.outputs import SequenceOutput
from afdserve.engine.sampling_params import SamplingParams


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, averaged over attention ranks
    steps: dict[str, int] = field(default_factory=dict)  # "role:mode" -> count


class EngineClient(ABC):
    max_model_len: int
    vocab_size: int

    @abstractmethod
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Raises RequestError for a request the engine refuses; others are unaffected."""

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def step(self) -> list[SequenceOutput]:
        """Advance the engine; returns the outputs that changed. Returns [] promptly when idle."""

    @property
    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def stats(self) -> EngineStats: ...

    def step_log(self) -> list[dict]:
        return []

    def shutdown(self) -> None:
        return None
