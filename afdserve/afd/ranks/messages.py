"""Messages between the frontend and its rank processes: frozen dataclasses, dispatched by type.

Frontend -> rank: `WorkerSpec` (once, first), then `AddRequest`, `AbortRequest`, `Shutdown`,
and `Rejoin` after the rank `Parted`.
Rank -> frontend: `Hello` (first), `RankReady`, then `Outputs`, `Rejected`, `RankFailed`, or
`Parted` when its world broke under it (it keeps its half and waits for `Rejoin` or `Shutdown`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from afdserve.config import AFDConfig, EngineConfig, GraphConfig
from afdserve.engine.device import with_batch_limits
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
    # The rendezvous store of the world generation this rank joins (a rank replacing a failed
    # one joins the survivors' new store); None: AFDSERVE_STORE_PATH, or env:// under torchrun.
    store_path: str | None = None
    generation: int = 0

    def __post_init__(self) -> None:
        # A spec built by hand (tests, benches) may leave the batch limits "auto"; the LLM
        # resolves them before it hands every rank the same spec.
        object.__setattr__(self, "engine", with_batch_limits(self.engine))

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
    # The world generation joined, and how many times this process has loaded its half: a rank
    # that survived a failure and rejoined says generation > 0 with loads == 1.
    generation: int = 0
    loads: int = 1


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
class Nudge:
    """Frontend -> an attention rank: another attention rank was given work. Every rank of a
    world joins each control round, so an idle one waiting on its channel steps at once
    instead of after its backoff; it carries nothing."""


@dataclass(frozen=True)
class Rejoin:
    """Frontend -> a rank that `Parted`: join world generation `generation` through the store
    at `store_path` (a fresh file in the world's 0700 directory), keeping the half it holds."""

    generation: int
    store_path: str


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
    # Speculative decoding, cumulative (engine/speculative.py SpecStats); None when it is off.
    spec_decode: tuple[int, ...] | None = None  # drafts, draft tokens, accepted, then per position


@dataclass(frozen=True)
class Outputs:
    """A step's token deltas as the engine core made them. Sending the whole output every step
    pickled and authenticated the prompt and every token so far: about 11 ms per step at batch
    256 with 512-token prompts on a 2-core box, against 0.2 ms for deltas, and the rank's next
    step waits for it. Text is the frontend's (frontend/output_processor.py)."""

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


@dataclass(frozen=True)
class Parted:
    """A rank whose world broke while serving (a peer died, hung, or left): it has dropped its
    process groups, control plane and connectors and its requests (their KV blocks freed), kept
    its half and its KV cache allocation, and waits for `Rejoin` (or `Shutdown`)."""

    rank: int
    reason: str
