"""User-facing configuration: one frozen dataclass per concern, validated on construction.

Every error names the field, the value it got and what is allowed, and is raised before any process
starts or any weight is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from afdserve.config_args import build, option, parse_placement, parse_sizes, split_kwargs

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other spellings of them (its --dtype accepts each).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DEVICES = ("cpu", "cuda")
# "auto": CUDA when this torch sees a GPU, else the CPU (engine/device.py resolves it).
DEVICE_CHOICES = ("auto", *DEVICES)
GRAPH_MODES = ("none", "full_decode_only", "full")
# "auto": full_decode_only on CUDA unless enforce_eager, none elsewhere (GraphConfig.resolved).
GRAPH_MODE_CHOICES = ("auto", *GRAPH_MODES)
CONNECTORS = ("auto", "p2p", "ipc", "inprocess")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = ("fp8",)  # the values of EngineConfig.quantization (model/quantization.py)
CONTROL_PLANES = ("auto", "gloo", "shm")
# The values of EngineConfig.kv_cache_dtype: vLLM's names ("fp8_e4m3" is its alias of "fp8").
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DEFAULT_BLOCK_SIZE = 16  # vLLM's on CUDA; EngineConfig.block_size "auto" starts from it
A2E_DTYPES = ("auto", "bfloat16", "fp8")  # the formats of kernels/a2e.py
ROUTING_POLICIES = ("prefix", "least-tokens")  # frontend/routing.py
ENGINE_PROCESS = ("auto", "on", "off")  # AFDConfig.own_engine_process


def _one_one():
    from afdserve.layout.topology import Topology

    return Topology(1, 1)


def _require(ok: bool, owner: str, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{owner}.{name}={value!r} is not allowed: {allowed}")


def _positive_int(owner: str, name: str, value: object) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    _require(ok, owner, name, value, "an integer >= 1")


# Speculative decoding (vLLM's --speculative-config): the methods run. `deepseek_mtp` is vLLM's
# other spelling of `mtp` (the checkpoint's next-token-prediction layers draft).
SPECULATIVE_METHODS = ("ngram", "mtp", "deepseek_mtp")
MTP_METHODS = ("mtp", "deepseek_mtp")
# Why connector "ipc" does not carry MTP drafts: its symmetric inboxes alternate per layer and
# ubatch of the main step, and the draft passes after it (layer N) are not built or tested there
# (CUDA only); "p2p" and "inprocess" carry them.
MTP_IPC_REFUSAL = (
    "connector='ipc' does not carry the MTP layer's draft passes yet; use connector='p2p'"
)
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def _check_method(method: object) -> None:
    _require(
        method in SPECULATIVE_METHODS,
        "SpeculativeConfig",
        "method",
        method,
        f"one of {SPECULATIVE_METHODS}",
    )


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config. `ngram`: each decoding sequence's longest suffix n-gram
    (prompt_lookup_min <= n <= prompt_lookup_max) found earlier in its own tokens proposes the
    up to num_speculative_tokens tokens that followed it. Only one of the lookup bounds given:
    the other takes its value; neither: both 5 (vLLM's defaults). `mtp` (`deepseek_mtp`): the
    checkpoint's next-token-prediction layer drafts (engine/mtp.py); the bounds are unused."""

    method: str = "ngram"
    num_speculative_tokens: int = 1
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        owner = "SpeculativeConfig"
        _check_method(self.method)
        _positive_int(owner, "num_speculative_tokens", self.num_speculative_tokens)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        _positive_int(owner, "prompt_lookup_min", low)
        _positive_int(owner, "prompt_lookup_max", high)
        _require(low <= high, owner, "prompt_lookup_min", low, f"at most prompt_lookup_max={high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @property
    def is_mtp(self) -> bool:
        return self.method in MTP_METHODS

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """From a dict, its JSON text (the flag's) or a SpeculativeConfig; None stays None.
        A key other than vLLM's n-gram ones is refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"speculative_config={value!r}: expected a dict or its JSON text, with keys "
                f"{SPECULATIVE_KEYS}"
            )
        unknown = [key for key in value if key not in SPECULATIVE_KEYS]
        if unknown:
            raise ValueError(
                f"speculative_config: key {unknown[0]!r} is not supported; the keys are "
                f"{SPECULATIVE_KEYS}"
            )
        if "method" not in value:
            raise ValueError(
                f"speculative_config: 'method' is required, one of {SPECULATIVE_METHODS}"
            )
        _check_method(value["method"])
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: 'num_speculative_tokens' is required")
        return cls(**value)


def _speculative_flag(text: str) -> SpeculativeConfig | None:
    """--speculative-config's parse: argparse shows an ArgumentTypeError's own message."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class EngineConfig:
    """One attention rank's engine: model, device, cache and scheduler limits."""

    model: str = option(
        help="a Hugging Face model directory, or a hub id (org/name) read "
        "through the Hugging Face cache",
        positional=True,
        shown="the bundled tiny model",
    )
    device: str = option(
        "auto",
        help="where the engine runs: auto (CUDA when this torch sees a "
        "GPU, else cpu), cpu, cuda or cuda:N",
    )
    dtype: str = option(
        "auto",
        allowed=(*DTYPES, *DTYPE_ALIASES),
        help="of weights and activations; auto: the checkpoint's torch_dtype; "
        "half is float16 and float is float32, as in vLLM",
    )
    max_num_seqs: int | None = option(
        None,
        help="the most sequences one step runs",
        shown="auto: 1024 on a GPU of 70 GiB or more other than an A100, 256 on other GPUs, "
        "64 on the CPU",
    )
    max_num_batched_tokens: int | None = option(
        None,
        help="the most tokens one step runs (prompt chunks and decodes together)",
        shown="auto: 8192 for the server and 16384 offline on a GPU of 70 GiB or more other "
        "than an A100, 2048 and 8192 on other GPUs, 2048 on the CPU; at most max_num_seqs x "
        "max_model_len",
    )
    max_model_len: int | None = option(
        None,
        help="the longest prompt plus output, in tokens",
        shown="the model's max_position_embeddings",
    )
    kv_cache_blocks: int | None = option(
        None,
        help="KV-cache blocks per attention rank",
        shown="what gpu_memory_utilization leaves on CUDA; max_num_seqs x max_model_len on CPU, "
        "at most 1 GiB",
    )
    block_size: int | None = option(
        None,
        help="tokens per KV-cache block",
        shown=f"{DEFAULT_BLOCK_SIZE}, or with prefix caching on the smallest multiple of it at "
        "which the model's cache can reuse a block by its prefix: 128 for DeepSeek-V4-Flash, "
        "its longest compress rate",
    )
    gpu_memory_utilization: float = option(
        0.85,
        help="the share of its GPU's memory a rank may fill: its KV cache gets what is "
        "left of that share once its weights are loaded",
    )
    seed: int = option(
        0, help="seed of the engine's generator, for requests without a seed, and of dummy weights"
    )
    load_format: str = option(
        "auto",
        choices=LOAD_FORMATS,
        help="auto and safetensors read the checkpoint's safetensors; dummy builds the model "
        "from config.json alone with random weights drawn from the seed (like vLLM's dummy "
        "format), the same on every rank of every topology",
    )
    use_tqdm_on_load: bool = option(
        True, help="a progress bar over checkpoint shards while loading (on a terminal)"
    )
    quantization: str | None = option(
        None,
        allowed=QUANTIZATIONS,
        help="fp8: block-scaled FP8 weights (float8_e4m3fn, a float32 scale per 128x128 block) "
        "as DeepSeek-V3's checkpoints store them; a checkpoint in another dtype (or dummy "
        "weights) is quantized at load. An FP8 checkpoint is read as FP8 either way",
        shown="as the checkpoint's quantization_config says",
    )
    kv_cache_dtype: str = option(
        "auto",
        allowed=KV_CACHE_DTYPES,
        help="of the paged KV cache: auto, the model's dtype; fp8 (alias fp8_e4m3): "
        "float8_e4m3fn with a per-tensor scale of 1.0 (vLLM's default for checkpoints "
        "without KV scales), half the bytes of bf16, so twice the cached tokens",
    )
    enable_prefix_caching: bool | None = option(
        None,
        help="automatic prefix caching: a request's longest prefix of full blocks already "
        "in its attention rank's KV cache is taken from there, not recomputed",
        shown="on, except for a model whose cache cannot reuse blocks by prefix",
    )
    speculative_config: SpeculativeConfig | None = option(
        None,
        parse=_speculative_flag,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": '
        'K, "prompt_lookup_max": N, "prompt_lookup_min": M}\' (a dict for LLM()); verification '
        "is lossless (greedy tokens unchanged, sampling by rejection against the target)",
        shown="none",
    )
    # Where the model comes from (model/checkpoint/hub.py): the LLM hands the ranks local
    # directories.
    revision: str | None = option(
        None, help="with a hub id: the branch, tag or commit to load", shown="main"
    )
    tokenizer: str | None = option(
        None, help="the tokenizer's directory or hub id, when not the model's", shown="the model's"
    )
    download_dir: str | None = option(
        None,
        metavar="DIR",
        help="the Hugging Face cache that hub ids are downloaded to and read from",
        shown="$HF_HUB_CACHE, else $HF_HOME/hub",
    )
    trust_remote_code: bool = option(
        False,
        help="let transformers run a tokenizer's own Python code (tokenization_*.py, "
        "also downloaded then); the model itself always runs afdserve's own code "
        "for its architecture, so no model code from a checkpoint ever runs",
    )

    def __post_init__(self) -> None:
        owner = "EngineConfig"
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        _require(
            self.load_format in LOAD_FORMATS,
            owner,
            "load_format",
            self.load_format,
            f"one of {LOAD_FORMATS}",
        )
        _require(
            self.device == "auto" or self.device.split(":")[0] in DEVICES,
            owner,
            "device",
            self.device,
            f"one of {DEVICE_CHOICES} (optionally 'cuda:N')",
        )
        _require(
            self.dtype in DTYPES, owner, "dtype", self.dtype, f"one of {(*DTYPES, *DTYPE_ALIASES)}"
        )
        for name in ("revision", "tokenizer", "download_dir"):
            value = getattr(self, name)
            _require(
                value is None or (isinstance(value, str) and value != ""),
                owner,
                name,
                value,
                "a non-empty string, or None",
            )
        _require(
            isinstance(self.trust_remote_code, bool),
            owner,
            "trust_remote_code",
            self.trust_remote_code,
            "True or False",
        )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) is not None:
                _positive_int(owner, name, getattr(self, name))
        if self.max_model_len is not None:
            _positive_int(owner, "max_model_len", self.max_model_len)
        if self.kv_cache_blocks is not None:
            _positive_int(owner, "kv_cache_blocks", self.kv_cache_blocks)
        ok = isinstance(self.gpu_memory_utilization, float) and 0 < self.gpu_memory_utilization <= 1
        _require(
            ok, owner, "gpu_memory_utilization", self.gpu_memory_utilization, "a float in (0, 1]"
        )
        _require(
            isinstance(self.use_tqdm_on_load, bool),
            owner,
            "use_tqdm_on_load",
            self.use_tqdm_on_load,
            "True or False",
        )
        _require(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            owner,
            "quantization",
            self.quantization,
            f"None or one of {QUANTIZATIONS}",
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            owner,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            f"one of {KV_CACHE_DTYPES}",
        )
        _require(
            self.enable_prefix_caching in (None, True, False),
            owner,
            "enable_prefix_caching",
            self.enable_prefix_caching,
            "None (on where the model allows), True or False",
        )

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    def with_batch_defaults(
        self, usage: str, device: str, gpu_bytes: int = 0, gpu_name: str = ""
    ) -> EngineConfig:
        """This config with max_num_seqs and max_num_batched_tokens "auto" (None) replaced by
        `batch_defaults` for the resolved `device`; a defaulted token budget is no larger than
        max_num_seqs sequences of max_model_len tokens could use, as in vLLM."""
        if usage not in USAGES:
            raise ValueError(f"usage={usage!r}: one of {USAGES}")
        seqs, tokens = batch_defaults(device, usage, gpu_bytes, gpu_name)
        max_num_seqs = self.max_num_seqs if self.max_num_seqs is not None else seqs
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            longest = self.max_model_len if self.max_model_len is not None else tokens
            max_num_batched_tokens = min(tokens, max_num_seqs * longest)
        return dataclasses.replace(
            self, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )


# What max_num_seqs and max_num_batched_tokens "auto" become, by device and usage, as vLLM's
# EngineArgs.get_batch_defaults sets them on GPUs (its A100 exception included: a large token
# budget lowered its throughput there); the CPU keeps small steps.
USAGES = ("llm", "server")
LARGE_GPU_BYTES = 70 << 30


def batch_defaults(
    device: str, usage: str, gpu_bytes: int = 0, gpu_name: str = ""
) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for `device` ("cpu", "cuda[:N]"), `usage` ("llm":
    offline, "server"), and the GPU's total memory and name."""
    if not device.startswith("cuda"):
        return 64, 2048
    if gpu_bytes >= LARGE_GPU_BYTES and "a100" not in gpu_name.lower():
        return 1024, 8192 if usage == "server" else 16384
    return 256, 2048 if usage == "server" else 8192


# The largest batch captured by default (as vLLM's): a larger decode batch runs eagerly, where
# its launches weigh less against its work.
MAX_DEFAULT_CAPTURE = 512


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 256 and every 16 past it, up to max_num_seqs or 512
    (the largest is always included)."""
    top = min(max_num_seqs, MAX_DEFAULT_CAPTURE)
    ladder = [s for s in (1, 2, 4) if s < top]
    ladder += list(range(8, min(top, 256), 8)) + list(range(256, top, 16))
    return tuple(sorted(set(ladder + [top])))


@dataclass(frozen=True)
class GraphConfig:
    """CUDA-graph policy. `sizes=None` means the default ladder up to max_num_seqs."""

    mode: str = option(
        "auto",
        kwarg="graph_mode",
        allowed=GRAPH_MODE_CHOICES,
        help="CUDA graphs: full_decode_only captures decode-only steps, full "
        "also steps with prompt chunks, none runs eagerly; auto: "
        "full_decode_only on CUDA (as vLLM captures by default), none on "
        "the CPU or with --enforce-eager",
    )
    sizes: tuple[int, ...] | None = option(
        None,
        kwarg="cuda_graph_sizes",
        parse=parse_sizes,
        metavar="N,N,...",
        help="the batch sizes captured, comma-separated",
        shown="1,2,4,8,16,... every 8 up to 256, every 16 past it, up to max_num_seqs or 512",
    )
    # vLLM's switch: graphs are on by default on CUDA, this turns them off.
    enforce_eager: bool = option(
        False,
        help="capture no CUDA graphs (graph_mode auto becomes none); contradicts an "
        "explicit graph_mode other than none",
    )

    def __post_init__(self) -> None:
        owner = "GraphConfig"
        _require(
            self.mode in GRAPH_MODE_CHOICES,
            owner,
            "mode",
            self.mode,
            f"one of {GRAPH_MODE_CHOICES}",
        )
        _require(
            isinstance(self.enforce_eager, bool),
            owner,
            "enforce_eager",
            self.enforce_eager,
            "True or False",
        )
        if self.enforce_eager and self.mode not in ("auto", "none"):
            raise ValueError(
                f"GraphConfig.enforce_eager=True contradicts graph_mode="
                f"{self.mode!r}: give one or the other"
            )
        if self.sizes is not None:
            sizes = tuple(self.sizes)
            ok = len(sizes) > 0 and all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes
            )
            _require(ok, owner, "sizes", self.sizes, "a non-empty list of integers >= 1")
            object.__setattr__(self, "sizes", tuple(sorted(set(sizes))))

    def resolved(self, device: str) -> GraphConfig:
        """This config with mode "auto" replaced by what it stands for on `device` (a resolved
        device: "cpu", "cuda" or "cuda:N"); the ranks only ever see a resolved mode."""
        if self.mode != "auto":
            return self
        on_cuda = device.startswith("cuda") and not self.enforce_eager
        return dataclasses.replace(self, mode="full_decode_only" if on_cuda else "none")

    def capture_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        if self.mode == "auto":
            raise ValueError("GraphConfig.mode='auto' must be resolved for a device first")
        if self.mode == "none":
            return ()
        return self.sizes if self.sizes is not None else default_capture_sizes(max_num_seqs)


@dataclass(frozen=True)
class AFDConfig:
    """How the model is split across ranks."""

    topology: str = option(
        "colocated",
        help="'colocated' or <A>A<F>F, e.g. 2A1F; <N>A0F is "
        "N data-parallel replicas (--data-parallel-size N)",
    )
    ubatches: int = option(
        1, help="micro-batches per step (1..4), so that attention and FFN ranks work at once"
    )
    gate_on_attention: bool = option(False, help="run the MoE router on the attention ranks")
    log_step_plan: bool | str = option(
        False,
        parse=str,
        nargs="?",
        const=True,
        metavar="PATH",
        help="write one JSON line per rank per step (to PATH; LLM.step_log() reads them)",
    )
    connector: str = option(
        "auto",
        choices=CONNECTORS,
        help="the data plane of an AFD topology: p2p, one process per rank over "
        "torch.distributed point-to-point (NCCL on CUDA, gloo on CPU); ipc, one process "
        "per rank, each on its own GPU of one host, tiles written straight into the "
        "peer's symmetric memory; inprocess, 1A1F with both halves in this process (one "
        "device); auto: ipc when every rank gets a GPU of its own, else inprocess for "
        "1A1F on CUDA, else p2p",
    )
    timeout_s: float = option(
        300.0,
        flag="--dist-timeout",
        metavar="S",
        help="a collective or transfer that does not complete in this many seconds fails",
    )
    heartbeat_timeout_s: float = option(
        10.0,
        metavar="S",
        help="an attention rank that reports no step for this many seconds is hung (or waits "
        "on a hung rank): every request fails and the world stops",
    )
    control_plane: str = option(
        "auto",
        allowed=CONTROL_PLANES,
        help="how ranks exchange their step reports: gloo (an all-gather, any hosts), shm (a "
        "shared-memory board, every rank on one x86-64 Linux host); auto: shm when the "
        "built-in launcher started every rank on this host and the host supports it, gloo "
        "otherwise",
    )
    # Read back by `afdserve.afd.dataplane.wire.mirror_errors`.
    log_data_plane: str | None = option(
        None,
        metavar="DIR",
        help="every rank writes each point-to-point batch it posts (and an FFN rank each "
        "header it receives) to DIR/rank<N>.jsonl",
    )
    ffn_expert_parallel: bool = option(
        False,
        help="the FFN ranks form one expert-parallel group, each holding a disjoint "
        "shard of the routed experts (allows A < F, e.g. 1A2F)",
    )
    expert_placement: tuple[tuple[int, ...], ...] | None = option(
        None,
        parse=parse_placement,
        metavar="E,E;E,E",
        help="with ffn_expert_parallel: the routed experts of each FFN rank, ';' between ranks "
        "(every expert exactly once)",
        shown="contiguous near-equal shards",
    )
    a2e_dtype: str = option(
        "auto",
        allowed=A2E_DTYPES,
        help="the hidden rows the attention side hands to the FFN: auto, in the model dtype; "
        "bfloat16; fp8, float8_e4m3fn with a float32 scale per 128 channels of a row (half "
        "the bytes). The FFN output comes back in the model dtype. Colocated runs the same "
        "round trip at the FFN boundary, so every topology gives the same tokens",
        shown="auto, the model dtype",
    )
    engine_process: str = option(
        "auto",
        choices=ENGINE_PROCESS,
        help="where a colocated engine (one attention rank, no FFN rank) steps: on, in a "
        "process of its own, so that the frontend's per-request work (HTTP, tokenizing, "
        "detokenizing, streaming) never holds the interpreter lock its step needs (vLLM's "
        "engine core process); off, in the caller's process; auto: on for serve on CUDA, off "
        "offline and on CPU (where both processes share the host's few cores). AFD ranks "
        "always have processes of their own, in-process 1A1F excepted",
    )
    routing_policy: str = option(
        "prefix",
        choices=ROUTING_POLICIES,
        help="how the frontend picks the attention rank of a request: least-tokens, the one "
        "with the least outstanding work; prefix, the same less the prompt tokens the rank "
        "holds in its prefix cache (as least-tokens when prefix caching is off)",
    )
    # vLLM's data parallelism: N colocated engines (topology <N>A0F), one process each (one GPU
    # each on CUDA), behind one frontend that routes as it routes to AFD attention ranks.
    data_parallel_size: int = option(
        1,
        aliases=("-dp",),
        help="this many colocated replicas of the whole model, one process (and on CUDA one "
        "GPU) each, requests spread across them; the same as --topology <N>A0F",
    )
    # vLLM's other two splits, which afdserve does not have: refused unless 1, saying what to use.
    tensor_parallel_size: int = option(
        1,
        aliases=("-tp",),
        help="not supported: only 1 (afdserve splits a model into attention and FFN ranks "
        "instead: --topology <A>A<F>F, with --ffn-expert-parallel for the experts)",
    )
    pipeline_parallel_size: int = option(
        1,
        aliases=("-pp",),
        help="not supported: only 1 (use --topology <A>A<F>F, or --data-parallel-size for "
        "replicas)",
    )

    def __post_init__(self) -> None:
        from afdserve.layout.experts import check_placement_shape
        from afdserve.layout.topology import Topology

        owner = "AFDConfig"
        self._data_parallel()
        _require(
            isinstance(self.ffn_expert_parallel, bool),
            owner,
            "ffn_expert_parallel",
            self.ffn_expert_parallel,
            "True or False",
        )
        topology = Topology.parse(self.topology, expert_parallel=self.ffn_expert_parallel)
        if self.expert_placement is not None:
            _require(
                self.ffn_expert_parallel,
                owner,
                "expert_placement",
                self.expert_placement,
                "None unless ffn_expert_parallel=True",
            )
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
        _require(
            isinstance(self.heartbeat_timeout_s, (int, float)) and self.heartbeat_timeout_s > 0,
            owner,
            "heartbeat_timeout_s",
            self.heartbeat_timeout_s,
            "a number of seconds > 0",
        )
        _require(
            self.control_plane in CONTROL_PLANES,
            owner,
            "control_plane",
            self.control_plane,
            f"one of {CONTROL_PLANES}",
        )
        _require(
            self.connector in CONNECTORS, owner, "connector", self.connector, f"one of {CONNECTORS}"
        )
        _require(
            self.a2e_dtype in A2E_DTYPES, owner, "a2e_dtype", self.a2e_dtype, f"one of {A2E_DTYPES}"
        )
        _require(
            self.routing_policy in ROUTING_POLICIES,
            owner,
            "routing_policy",
            self.routing_policy,
            f"one of {ROUTING_POLICIES}",
        )
        if self.connector == "ipc" and self.a2e_dtype == "fp8":
            # The push kernel writes model-dtype rows; its quantizing form is not written yet.
            raise ValueError(
                "AFDConfig.a2e_dtype='fp8' is not carried by connector='ipc' yet: "
                "use connector='p2p' or 'inprocess'"
            )
        if self.connector == "ipc" and topology.colocated:
            raise ValueError(
                "AFDConfig.connector='ipc' needs an AFD topology such as 1A1F, "
                f"got {self.topology!r}"
            )
        if self.connector == "inprocess" and topology != Topology(1, 1):
            raise ValueError(
                f"AFDConfig.connector='inprocess' needs topology 1A1F without "
                f"ffn_expert_parallel, got {self.topology!r} "
                f"(ffn_expert_parallel={self.ffn_expert_parallel})"
            )

    def _data_parallel(self) -> None:
        """data_parallel_size and topology <N>A0F are one setting: each sets the other, and
        the two given apart must agree. tensor/pipeline parallel sizes other than 1 are
        refused with what to use instead."""
        owner = "AFDConfig"
        for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
            _positive_int(owner, name, getattr(self, name))
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"{owner}.tensor_parallel_size={self.tensor_parallel_size} is not supported: "
                "afdserve has no tensor parallelism; split the model into attention and FFN "
                "ranks with --topology <A>A<F>F (e.g. 1A1F; --ffn-expert-parallel shards the "
                "experts), or run replicas with --data-parallel-size N"
            )
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                f"{owner}.pipeline_parallel_size={self.pipeline_parallel_size} is not "
                "supported: afdserve has no pipeline parallelism; use --topology <A>A<F>F, or "
                "--data-parallel-size N for replicas"
            )
        if not isinstance(self.topology, str):
            return  # Topology.parse says what is wrong with it
        match = re.fullmatch(r"\s*([0-9]+)A0F\s*", self.topology, re.IGNORECASE)
        replicas = int(match[1]) if match else 1 if self.topology.strip() == "colocated" else None
        if self.data_parallel_size == 1:
            if replicas is not None and replicas > 1:
                object.__setattr__(self, "data_parallel_size", replicas)
            return
        if replicas == 1 or replicas == self.data_parallel_size:
            object.__setattr__(self, "topology", f"{self.data_parallel_size}A0F")
            return
        raise ValueError(
            f"{owner}.data_parallel_size={self.data_parallel_size} is not allowed with "
            f"topology={self.topology!r}: replicas are colocated engines (topology "
            f"'{self.data_parallel_size}A0F'); an AFD topology already has several attention "
            "ranks, so give its attention ranks there (e.g. '2A1F') instead"
        )

    def check_device(self, device: str) -> None:
        """The connector can run on `device` (checked before any rank starts; "auto" is
        checked again once resolved)."""
        if self.connector == "ipc" and device != "auto" and not device.startswith("cuda"):
            raise ValueError(
                f"AFDConfig.connector='ipc' needs device='cuda' (symmetric GPU "
                f"memory), got device={device!r}; use connector='p2p' on CPU"
            )

    def resolve_connector(
        self, device: str, gpus: int, spawned: bool, mtp: bool = False
    ) -> AFDConfig:
        """This config with "auto" replaced by the connector it stands for: "ipc" when the built-in
        launcher spawns every rank on a GPU of its own (one host; measured fastest, see
        afd/dataplane/ipc.py); "inprocess" for 1A1F on CUDA with fewer GPUs than ranks; "p2p"
        otherwise (CPU, ranks started elsewhere, and expert-parallel groups, fp8 A2E rows and
        MTP drafts (`mtp`), not yet run over ipc)."""
        topology = self.parsed_topology
        if self.connector != "auto" or topology.colocated:
            return self
        cuda = device.startswith("cuda")
        ipc_ok = not topology.expert_parallel and self.a2e_dtype != "fp8" and not mtp
        if cuda and spawned and gpus >= topology.world_size and ipc_ok:
            chosen = "ipc"
        elif cuda and spawned and topology == _one_one() and gpus < topology.world_size:
            chosen = "inprocess"
        else:
            chosen = "p2p"
        return dataclasses.replace(self, connector=chosen)

    def own_engine_process(self, device: str, usage_context: str) -> bool:
        """Whether a colocated engine of one rank steps in a rank process of its own."""
        if self.engine_process == "auto":
            return usage_context == "server" and device.startswith("cuda")
        return self.engine_process == "on"

    def in_process(self, device: str) -> bool:
        if self.connector == "auto":
            return self.parsed_topology == _one_one() and device.startswith("cuda")
        return self.connector == "inprocess"

    @property
    def parsed_topology(self):  # -> Topology (imported lazily: topology has no torch import)
        from afdserve.layout.topology import Topology

        return Topology.parse(self.topology, expert_parallel=self.ffn_expert_parallel)


ENGINE_CONFIGS = (EngineConfig, AFDConfig, GraphConfig)


class EngineConfigs(NamedTuple):
    engine: EngineConfig
    afd: AFDConfig
    graph: GraphConfig


def engine_configs(
    kwargs: Mapping[str, object], owner: str = "LLM()", also: Iterable[str] = ()
) -> EngineConfigs:
    """The three configs from keywords named as `LLM`'s (`model` a resolved directory): an
    unknown keyword is a TypeError naming it and the allowed ones (`also`: the caller's own),
    a wrong value the ValueError of its field, before any process starts."""
    engine, afd, graph = split_kwargs(kwargs, ENGINE_CONFIGS, owner, also)
    engine_config = build(EngineConfig, engine)
    afd_config = build(AFDConfig, afd)
    afd_config.check_device(engine_config.device)
    return EngineConfigs(engine_config, afd_config, build(GraphConfig, graph))
