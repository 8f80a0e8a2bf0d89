"""User-facing configuration: one frozen dataclass per concern, validated on construction.

Every error names the field, the value it got and what is allowed, and is raised before any process
starts or any weight is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
GRAPH_MODES = ("none", "full_decode_only", "full")
CONNECTORS = ("auto", "p2p", "ipc", "inprocess")
# "auto" and "safetensors" read the checkpoint's safetensors; "dummy" builds the model from
# config.json alone with random weights drawn from EngineConfig.seed (like vLLM's dummy format).
LOAD_FORMATS = ("auto", "safetensors", "dummy")
CONTROL_PLANES = ("auto", "gloo", "shm")


def _one_one():
    from afdserve.layout.topology import Topology

    return Topology(1, 1)


def _require(ok: bool, owner: str, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{owner}.{name}={value!r} is not allowed: {allowed}")


def check_model_dir(model: str) -> None:
    """A model must be a local Hugging Face directory: say so in one line, before loading."""
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"model={model!r}: no such directory (expected a Hugging Face model dir)")
    if not (path / "config.json").is_file():
        raise ValueError(f"model={model!r}: the directory has no config.json")


def _positive_int(owner: str, name: str, value: object) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    _require(ok, owner, name, value, "an integer >= 1")


@dataclass(frozen=True)
class EngineConfig:
    """One attention rank's engine: model, device, cache and scheduler limits."""

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_blocks: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.85
    seed: int = 0
    load_format: str = "auto"
    use_tqdm_on_load: bool = True  # a progress bar over checkpoint shards, on a terminal

    def __post_init__(self) -> None:
        owner = "EngineConfig"
        _require(self.load_format in LOAD_FORMATS, owner, "load_format", self.load_format,
                 f"one of {LOAD_FORMATS}")
        _require(
            self.device.split(":")[0] in DEVICES,
            owner,
            "device",
            self.device,
            f"one of {DEVICES} (optionally 'cuda:N')",
        )
        _require(self.dtype in DTYPES, owner, "dtype", self.dtype, f"one of {DTYPES}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            _positive_int(owner, name, getattr(self, name))
        if self.max_model_len is not None:
            _positive_int(owner, "max_model_len", self.max_model_len)
        if self.kv_cache_blocks is not None:
            _positive_int(owner, "kv_cache_blocks", self.kv_cache_blocks)
        ok = isinstance(self.gpu_memory_utilization, float) and 0 < self.gpu_memory_utilization <= 1
        _require(
            ok, owner, "gpu_memory_utilization", self.gpu_memory_utilization, "a float in (0, 1]"
        )
        _require(isinstance(self.use_tqdm_on_load, bool), owner, "use_tqdm_on_load",
                 self.use_tqdm_on_load, "True or False")  # fmt: skip


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (which is always included)."""
    ladder = [s for s in (1, 2, 4) if s < max_num_seqs]
    ladder += list(range(8, max_num_seqs, 8))
    return tuple(sorted(set(ladder + [max_num_seqs])))


@dataclass(frozen=True)
class GraphConfig:
    """CUDA-graph policy. `sizes=None` means the default ladder up to max_num_seqs."""

    mode: str = "none"
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        owner = "GraphConfig"
        _require(self.mode in GRAPH_MODES, owner, "mode", self.mode, f"one of {GRAPH_MODES}")
        if self.sizes is not None:
            sizes = tuple(self.sizes)
            ok = len(sizes) > 0 and all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes
            )
            _require(ok, owner, "sizes", self.sizes, "a non-empty list of integers >= 1")
            object.__setattr__(self, "sizes", tuple(sorted(set(sizes))))

    def capture_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        if self.mode == "none":
            return ()
        return self.sizes if self.sizes is not None else default_capture_sizes(max_num_seqs)


@dataclass(frozen=True)
class AFDConfig:
    """How the model is split across ranks."""

    topology: str = "colocated"
    ubatches: int = 1
    gate_on_attention: bool = False
    log_step_plan: bool | str = False
    # "p2p": one process per rank over torch.distributed point-to-point (NCCL on CUDA, gloo on
    # CPU); "ipc": one process per rank, each on its own GPU of one host, tiles written straight
    # into the peer's symmetric memory (afd/dataplane/ipc.py); "inprocess": 1A1F with both halves
    # in this process (one device); "auto": see `resolve_connector`.
    connector: str = "auto"
    # A collective or transfer that does not complete within this many seconds fails (the
    # process groups' timeout).
    timeout_s: float = 300.0
    # An attention rank that reports no step for this many seconds is hung (or waits on a hung
    # rank): the frontend fails every request and stops the world.
    heartbeat_timeout_s: float = 10.0
    # How ranks exchange their step reports: "gloo" (an all-gather, any hosts), "shm" (a
    # shared-memory board, every rank on one x86-64 Linux host), "auto": shm when the built-in
    # launcher started every rank on this host and the host supports it, gloo otherwise.
    control_plane: str = "auto"
    # A directory: every rank writes each point-to-point batch it posts (and an FFN rank each
    # header it receives) to rank<N>.jsonl there, for `afdserve.afd.dataplane.wire.mirror_errors`.
    log_data_plane: str | None = None
    # The FFN ranks form one expert-parallel group: each holds a disjoint shard of the routed
    # experts (router, shared experts and dense layers are replicated), and A < F is allowed.
    ffn_expert_parallel: bool = False
    # With ffn_expert_parallel: the routed experts of each FFN rank, one list per FFN index
    # (every expert exactly once); None = contiguous near-equal shards.
    expert_placement: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        from afdserve.layout.experts import check_placement_shape
        from afdserve.layout.topology import Topology

        owner = "AFDConfig"
        _require(isinstance(self.ffn_expert_parallel, bool), owner, "ffn_expert_parallel",
                 self.ffn_expert_parallel, "True or False")
        topology = Topology.parse(self.topology, expert_parallel=self.ffn_expert_parallel)
        if self.expert_placement is not None:
            _require(self.ffn_expert_parallel, owner, "expert_placement",
                     self.expert_placement, "None unless ffn_expert_parallel=True")
            placement = check_placement_shape(self.expert_placement, topology.ffn_ranks)
            object.__setattr__(self, "expert_placement", placement)
        ok = isinstance(self.ubatches, int) and 1 <= self.ubatches <= 4
        _require(ok, owner, "ubatches", self.ubatches, "an integer in 1..4")
        _require(
            isinstance(self.gate_on_attention, bool),
            owner,
            "gate_on_attention",
            self.gate_on_attention,
            "True or False",
        )
        _require(self.timeout_s > 0, owner, "timeout_s", self.timeout_s, "a number > 0")
        _require(isinstance(self.heartbeat_timeout_s, (int, float))
                 and self.heartbeat_timeout_s > 0, owner, "heartbeat_timeout_s",
                 self.heartbeat_timeout_s, "a number of seconds > 0")
        _require(self.control_plane in CONTROL_PLANES, owner, "control_plane",
                 self.control_plane, f"one of {CONTROL_PLANES}")
        _require(self.connector in CONNECTORS, owner, "connector", self.connector,
                 f"one of {CONNECTORS}")
        if self.connector == "ipc" and topology.colocated:
            raise ValueError("AFDConfig.connector='ipc' needs an AFD topology such as 1A1F, "
                             f"got {self.topology!r}")
        if self.connector == "inprocess" and topology != Topology(1, 1):
            raise ValueError(
                f"AFDConfig.connector='inprocess' needs topology 1A1F without "
                f"ffn_expert_parallel, got {self.topology!r} "
                f"(ffn_expert_parallel={self.ffn_expert_parallel})"
            )

    def check_device(self, device: str) -> None:
        """The connector can run on `device` (checked before any rank starts)."""
        if self.connector == "ipc" and not device.startswith("cuda"):
            raise ValueError(f"AFDConfig.connector='ipc' needs device='cuda' (symmetric GPU "
                             f"memory), got device={device!r}; use connector='p2p' on CPU")

    def resolve_connector(self, device: str, gpus: int, spawned: bool) -> AFDConfig:
        """This config with "auto" replaced by the connector it stands for: "ipc" when the built-in
        launcher spawns every rank on a GPU of its own (one host; measured fastest, see
        afd/dataplane/ipc.py); "inprocess" for 1A1F on CUDA with fewer GPUs than ranks; "p2p"
        otherwise (CPU, ranks started elsewhere, and expert-parallel groups, not yet run over
        ipc)."""
        topology = self.parsed_topology
        if self.connector != "auto" or topology.colocated:
            return self
        cuda = device.startswith("cuda")
        if cuda and spawned and gpus >= topology.world_size and not topology.expert_parallel:
            chosen = "ipc"
        elif cuda and spawned and topology == _one_one():
            chosen = "inprocess"
        else:
            chosen = "p2p"
        return dataclasses.replace(self, connector=chosen)

    def in_process(self, device: str) -> bool:
        if self.connector == "auto":
            return self.parsed_topology == _one_one() and device.startswith("cuda")
        return self.connector == "inprocess"

    @property
    def parsed_topology(self):  # -> Topology (imported lazily: topology has no torch import)
        from afdserve.layout.topology import Topology

        return Topology.parse(self.topology, expert_parallel=self.ffn_expert_parallel)
