"""Messages between the frontend and its rank processes: frozen dataclasses, dispatched by type.

Frontend -> rank: `WorkerSpec` (once, first), then `AddRequest`, `AbortRequest`, `Shutdown`.
Rank -> frontend: `Hello` (first), `RankReady`, then `Outputs`, `Rejected`, `RankFailed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from afdserve.config import AFDConfig, EngineConfig, GraphConfig
from afdserve.engine.factory import MemoryReport
from afdserve.engine.requests import RequestLimits, TokenDelta
from afdserve.engine.sampling_params import SamplingParams
from afdserve.layout.topology import Topology


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build itself; the same for every rank of a world."""

    engine: EngineConfig
    afd: AFDConfig
    graphs: GraphConfig
    log_path: str | None = None
    threads: int = 1

    @property
    def topology(self) -> Topology:
        return self.afd.parsed_topology


@dataclass(frozen=True)
class Hello:
    rank: int


@dataclass(frozen=True)
class RankReady:
    rank: int
    role: str  # "attention" | "ffn"
    memory: MemoryReport
    tensor_names: tuple[str, ...]
    limits: RequestLimits | None  # attention ranks only
    prefix_caching: bool = False  # an attention rank that caches prefixes


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # A request resumed after a world failed: the tokens it had generated (engine_core.add_request)
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class RankStats:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    steps: dict[str, int] = field(default_factory=dict)  # "role:mode" -> count
    prefix_cache_queries: int = 0  # prompt tokens looked up, cumulative
    prefix_cache_hits: int = 0  # of which found cached
    preemptions: int = 0  # the scheduler's, cumulative
    # Tokens (real rows) of each step this rank computed since its previous report.
    step_tokens: tuple[int, ...] = ()
    # Cumulative over the rank's steps: tokens scheduled, wall seconds in the step's forward, of
    # which waiting for the FFN rank's replies, and the bytes of hidden rows sent (A2E) and
    # received (E2A) over the boundary.
    scheduled_tokens: int = 0
    forward_s: float = 0.0
    wait_s: float = 0.0
    a2e_bytes: int = 0
    e2a_bytes: int = 0
    # An FFN rank reports these figures too (no outputs, nothing else): forward_s is its FFN
    # half's steps, wait_s its waits for the tiles, scheduled_tokens the real rows it received.
    role: str = "attention"


@dataclass(frozen=True)
class Outputs:
    """A step's token deltas as the engine core made them. Sending the whole output every step
    pickled and authenticated the prompt and every token so far: about 11 ms per step at batch
    256 with 512-token prompts on a 2-core box, against 0.2 ms for deltas, and the rank's next
    step waits for it. Text is the frontend's (engine/output_processor.py)."""

    rank: int
    outputs: tuple[TokenDelta, ...]
    stats: RankStats


@dataclass(frozen=True)
class Rejected:
    rank: int
    request_id: str
    message: str


@dataclass(frozen=True)
class RankFailed:
    rank: int
    traceback: str
