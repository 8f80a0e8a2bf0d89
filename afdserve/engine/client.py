"""EngineClient: the one interface the offline API and the HTTP server drive, whatever the topology.

Not thread-safe: one thread owns a client (the server funnels requests through its engine thread).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from afdserve.engine.engine_core import EngineCore, RequestOutput
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
    def step(self) -> list[RequestOutput]:
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


class SingleProcessClient(EngineClient):
    """One process, one device. Colocated (the correctness reference and the speed baseline), or
    in-process 1A1F with the FFN half behind an InProcessConnector."""

    def __init__(self, core: EngineCore, recorder, topology, boundary) -> None:
        self.core, self.recorder, self.topology, self.boundary = core, recorder, topology, boundary
        self.max_model_len = core.max_model_len
        self.vocab_size = core.config.vocab_size
        recorder.warmup_single_process(core, topology, boundary)

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        self.core.add_request(request_id, prompt_token_ids, params)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def step(self) -> list[RequestOutput]:
        return self.recorder.single_process_step(self.core, self.topology, self.boundary)

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished

    def stats(self) -> EngineStats:
        s = self.core.scheduler
        return EngineStats(
            running=s.num_running,
            waiting=s.num_waiting,
            kv_cache_usage=self.core.block_manager.usage,
            steps=dict(self.recorder.mode_counts),
        )

    def step_log(self) -> list[dict]:
        return list(self.recorder.records)

    def shutdown(self) -> None:
        """Release the model, the KV cache and any graphs so the next engine gets the memory."""
        self.recorder.close()
        if self.core is None or self.core.device.type != "cuda":
            return
        import gc

        import torch

        self.core = self.boundary = None
        gc.collect()
        torch.cuda.empty_cache()
