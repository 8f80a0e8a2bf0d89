"""Builds one attention rank's engine (or a colocated engine) from an EngineConfig."""

from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass

import torch

from afdserve.config import DEFAULT_BLOCK_SIZE, EngineConfig, SpeculativeConfig
from afdserve.engine.device import resolve_device
from afdserve.engine.engine_core import EngineCore
from afdserve.engine.kv_cache import (
    bytes_per_block,
    cache_dtype,
    check_fp8_kv,
    make_kv_cache,
    slots_for,
    window_pool_bound,
)
from afdserve.engine.scheduler import SchedulerConfig
from afdserve.engine.tokenizer import load_tokenizer
from afdserve.model.cache import PagedCache
from afdserve.model.checkpoint.draft import load_draft, mtp_refusal
from afdserve.model.checkpoint.loader import LoadReport, load_model
from afdserve.model.config import ModelConfig
from afdserve.model.families import cache_layout
from afdserve.model.parts import CausalLM, ModelParts

log = logging.getLogger(__name__)

CPU_CACHE_BUDGET = 1 << 30  # bytes of KV cache on CPU when kv_cache_blocks is not given
MAX_AUTO_BLOCK_SIZE = 256  # the largest block size "auto" picks for prefix reuse


@dataclass(frozen=True)
class MemoryReport:
    role: str
    rank: int
    parameter_bytes: int
    cache_bytes: int
    parameter_names: int
    experts: tuple[int, ...] | None = None  # the routed experts held (an expert-parallel shard)
    cache_dtype: str | None = None  # the KV cache's torch dtype, e.g. "float8_e4m3fn"
    cache_blocks: int = 0

    def line(self) -> str:
        held = "" if self.experts is None else f", routed experts {list(self.experts)}"
        cache = f"KV cache {self.cache_bytes} bytes"
        if self.cache_dtype is not None:
            cache += f" ({self.cache_blocks} blocks, {self.cache_dtype})"
        return (
            f"{self.role} rank {self.rank}: parameters {self.parameter_bytes} bytes "
            f"({self.parameter_names} tensors{held}), {cache}"
        )


def max_model_len_for(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"EngineConfig.max_model_len={config.max_model_len} exceeds the model's "
            f"max_position_embeddings={limit}"
        )
    return config.max_model_len


def blocks_in_budget(free: int, total: int, utilization: float, per_block: int) -> int:
    """KV blocks in the device memory still free once the rank's weights are loaded, less the
    share `1 - utilization` of the device held back (activations, graphs, other processes). A
    rank that holds fewer weights (an attention rank holds no experts) gets more blocks."""
    return cache_budget(free, total, utilization) // per_block


def cache_budget(free: int, total: int, utilization: float) -> int:
    """Bytes of the device's free memory the cache may take (`blocks_in_budget`)."""
    return int(free - total * (1 - utilization))


@dataclass(frozen=True)
class CacheBlocks:
    """The cache's pools: `blocks` for every layer's table, `window_blocks` for the windowed
    layers' own (None: the layout has none)."""

    blocks: int
    window_blocks: int | None = None
    # Where the state slots live in the blocks' pages (`CacheLayout.slot_plan`): how many, and
    # the blocks each takes while held (0: the slots, if any, have memory of their own).
    slots: int = 0
    slot_pages: int = 0


def kv_blocks_for(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
    device: torch.device,
    extra_bytes_per_block: int = 0,
) -> int:
    """Blocks of the cache for `dtype` (`cache_blocks_for`'s main pool)."""
    pools = cache_blocks_for(
        config, model_config, dtype, max_model_len, device, extra_bytes_per_block
    )
    return pools.blocks


def cache_blocks_for(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
    device: torch.device,
    extra_bytes_per_block: int = 0,
) -> CacheBlocks:
    """The pools of the cache for `dtype`, the cache's own dtype (float8_e4m3fn: half a bf16
    block's bytes, so twice the blocks in the same budget). The state slots of a layout that
    keeps a state per sequence come out of the budget first where they have memory of their own
    (max_num_seqs of them); where they can live in the pages (`CacheLayout.slot_plan`) the pool
    holds them as blocks (`_shared`). Then the windowed layers' pool at its bound
    (`window_pool_bound`: it never needs more), and the rest goes to the main pool.
    `extra_bytes_per_block`: pages beside the model's over the same blocks (an MTP layer's)."""
    layout = cache_layout(model_config)
    bs = block_size_for(config, model_config)
    per_window = layout.bytes_per_window_block(bs, dtype)
    per_block = bytes_per_block(model_config, bs, dtype) - per_window + extra_bytes_per_block
    needed_one = -(-max_model_len // bs)
    bound = None
    if layout.window is not None:
        limits = (config.max_num_seqs, config.max_num_batched_tokens)
        bound = window_pool_bound(layout.window, bs, *limits)
    slot_pages = layout.slot_pages(bs, dtype)
    if config.kv_cache_blocks is not None:
        blocks = config.kv_cache_blocks
        if slot_pages:  # as given, like the blocks themselves: the scheduler says what fits
            return _shared(blocks, slot_pages, config, 1, max_model_len, bs)
        # Past blocks + 1 the window's pool is never short before the main one is.
        return CacheBlocks(blocks, None if bound is None else min(bound, blocks + 1))
    # State slots of memory of their own come out of the budget first; slots in the pages take
    # blocks as they are held (the pages past the blocks: their scratch slot).
    slots = 0 if slot_pages else slots_for(model_config, config.max_num_seqs, dtype)
    budget = -slots * layout.bytes_per_slot(dtype) - slot_pages * per_block
    want = None
    if device.type == "cuda":
        # An engine closed before this one may still hold its cache and graphs in reference
        # cycles; collect them and hand the allocator's unused blocks back to the device, so
        # the free memory measured is memory one allocation of the cache can take (reserved
        # blocks are fragments: counted as free, an 11 GiB cache failed to fit them on an H100).
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget += cache_budget(free, total, config.gpu_memory_utilization)
    else:
        budget += CPU_CACHE_BUDGET
        want = config.max_num_seqs * (needed_one + slot_pages)
    if per_block == 0:  # every layer windowed: the main table only counts positions
        window = min(bound, max(0, budget) // per_window)
        return CacheBlocks(config.max_num_seqs * needed_one, window)
    split = split_budget(max(0, budget), per_block, per_window, bound, want)
    if slot_pages:
        return _shared(split.blocks, slot_pages, config, needed_one, max_model_len, bs)
    if split.blocks < needed_one:
        held = ""
        if slots:  # the per-sequence state comes out of the budget first
            gib = slots * layout.bytes_per_slot(dtype) / (1 << 30)
            held = (
                f" (the state slots of max_num_seqs={config.max_num_seqs} sequences take "
                f"{gib:.1f} GiB first: lower max_num_seqs too)"
            )
        raise ValueError(
            f"KV cache: room for {split.blocks} blocks of {bs} tokens, but one sequence of "
            f"max_model_len={max_model_len} needs {needed_one}; lower max_model_len or free "
            f"memory{held}"
        )
    return split


def _shared(
    blocks: int, slot_pages: int, config: EngineConfig, needed_one: int, max_len: int, bs: int
) -> CacheBlocks:
    """The pool where every held state slot takes `slot_pages` of the `blocks`: slots for as
    many sequences as max_num_seqs, or as the pages could hold slots alone."""
    if blocks < needed_one + slot_pages:
        raise ValueError(
            f"KV cache: room for {blocks} blocks of {bs} tokens, but one sequence of "
            f"max_model_len={max_len} needs {needed_one} and its state slot {slot_pages} more; "
            "lower max_model_len or free memory"
        )
    slots = min(config.max_num_seqs, blocks // slot_pages)
    return CacheBlocks(blocks, slots=slots, slot_pages=slot_pages)


def max_concurrency(blocks: int, per_sequence: int, cache: PagedCache) -> float:
    """Sequences of `per_sequence` blocks the main pool holds at once, by memory (vLLM's
    start-up line; the scheduler's max_num_seqs aside): each with its state slot's blocks where
    the slots live in the pages."""
    return blocks / max(1, per_sequence + cache.slot_pages)


def split_budget(
    budget: int, per_block: int, per_window: int, bound: int | None, want: int | None = None
) -> CacheBlocks:
    """`budget` bytes as blocks of `per_block` bytes (at most `want`), after a windowed pool of
    `per_window` bytes a block at `bound` blocks; where the bound would not leave the main pool
    as many, both pools get equal counts (each window table is no longer than its sequence's
    main table, so the window's pool then never runs short first)."""
    if bound is None:
        blocks = budget // per_block
        return CacheBlocks(blocks if want is None else min(blocks, want))
    even = budget // (per_block + per_window)
    window = min(bound, even + 1, bound if want is None else want + 1)
    blocks = (budget - window * per_window) // per_block
    return CacheBlocks(blocks if want is None else min(blocks, want), window)


def block_size_for(config: EngineConfig, model_config: ModelConfig) -> int:
    """EngineConfig.block_size, "auto" (None) resolved: DEFAULT_BLOCK_SIZE, or with prefix
    caching not turned off the smallest multiple of it at which the model's cache can reuse a
    block by its prefix (a layout whose blocks must end on a compressor window: its rate), as vLLM
    raises a hybrid model's block size to what its cache needs. Where no size up to
    MAX_AUTO_BLOCK_SIZE can, prefix caching stays off and the block size stays the default."""
    if config.block_size is not None:
        return config.block_size
    if config.enable_prefix_caching is False:
        return DEFAULT_BLOCK_SIZE
    return auto_block_size(model_config)


def auto_block_size(model_config: ModelConfig) -> int:
    """The block size "auto" gives the model with prefix caching on (`block_size_for`); the
    benches' default too, so that they time the pages a default engine holds."""
    layout = cache_layout(model_config)
    sizes = range(DEFAULT_BLOCK_SIZE, MAX_AUTO_BLOCK_SIZE + 1, DEFAULT_BLOCK_SIZE)
    return next((b for b in sizes if layout.prefix_reuse_refusal(b) is None), DEFAULT_BLOCK_SIZE)


def with_block_size(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """`config` with block_size "auto" resolved (`block_size_for`)."""
    if config.block_size is not None:
        return config
    return dataclasses.replace(config, block_size=block_size_for(config, model_config))


def prefix_caching_for(config: EngineConfig, model_config: ModelConfig) -> bool:
    """Whether the rank caches prefixes: on unless turned off, and off where the model's cache
    layout cannot reuse a block by its prefix at this block size, where asking for it is an
    error rather than ignored."""
    why = cache_layout(model_config).prefix_reuse_refusal(block_size_for(config, model_config))
    if why is None:
        return config.enable_prefix_caching is not False
    if config.enable_prefix_caching:
        raise ValueError(
            f"EngineConfig.enable_prefix_caching=True is not supported for "
            f"{model_config.family}: {why}; leave the option unset or pass "
            "--no-enable-prefix-caching"
        )
    if config.enable_prefix_caching is None:
        log.info("prefix caching is off for %s (%s)", model_config.family, why)
    return False


def speculative_for(config: EngineConfig, model_config: ModelConfig) -> SpeculativeConfig | None:
    """The speculative config, refused for a cache that cannot leave rejected drafts' rows
    behind to be overwritten (`CacheSpec.rollback_refusal`: a ring or a recurrent state would
    have consumed them)."""
    speculative = config.speculative_config
    if speculative is None:
        return None
    layout = cache_layout(model_config)
    why = layout.rollback_refusal
    if why is not None:
        raise ValueError(
            f"EngineConfig.speculative_config is not supported for {model_config.family}: "
            f"rejected drafts' rows must be overwritable in place, and its cache cannot ({why})"
        )
    why = layout.draft_refusal(speculative.num_speculative_tokens)
    if why is not None:
        raise ValueError(f"EngineConfig.speculative_config for {model_config.family}: {why}")
    return speculative


def load_mtp_draft(
    config: EngineConfig, parts: ModelParts, model: CausalLM, device: torch.device, rank: int
):
    """The checkpoint's MTP layer, the halves `model` holds (`parts`: an attention rank's
    attention half, an FFN rank's MoE), refused by name where the checkpoint has none."""
    method = config.speculative_config.method
    why = mtp_refusal(config.model, model.config.family)
    if why is not None:
        raise ValueError(
            f"EngineConfig.speculative_config method={method!r} is not supported for "
            f"{config.model}: {why}"
        )
    return load_draft(
        config.model, model, config.load_format, config.seed, device, load_progress(config, rank)
    )


def load_ffn_draft(
    engine: EngineConfig, model: CausalLM, device: torch.device, rank: int
) -> CausalLM | None:
    """The MTP layer's FFN half (its router, experts and shared experts, the shard `model`
    holds), where speculation's method is mtp: the plan's draft passes run it as layer N."""
    speculative = engine.speculative_config
    if speculative is None or not speculative.is_mtp:
        return None
    return load_mtp_draft(engine, model.parts, model, device, rank)


def load_progress(config: EngineConfig, rank: int) -> bool | None:
    """Whether rank `rank` draws the weight-loading bar: only rank 0 (and only on a terminal),
    as in vLLM, because bars from several processes on one terminal overwrite each other."""
    return None if config.use_tqdm_on_load and rank == 0 else False


def create_engine_core(
    config: EngineConfig, parts: ModelParts, rank: int = 0, device: torch.device | None = None
) -> tuple[EngineCore, LoadReport, MemoryReport]:
    """`device` overrides config.device (a rank process picks its own GPU)."""
    device = device if device is not None else torch.device(resolve_device(config.device))
    model, report = load_half(config, parts, device, rank)
    config = with_block_size(config, model.config)
    # The model dtype, not the first parameter's (an FP8 weight's is float8); the cache's may be
    # FP8 on its own (kv_cache_dtype), which does not touch the weights.
    dtype = cache_dtype(config.kv_cache_dtype, model.dtype)
    if config.fp8_kv_cache:
        check_fp8_kv(model.config, device, report.unexpected)
    prefix_caching = prefix_caching_for(config, model.config)
    max_len = max_model_len_for(config, model.config)
    speculative = speculative_for(config, model.config)
    draft, draft_bytes = None, 0
    if speculative is not None and speculative.is_mtp:  # its weights and KV before the cache's
        draft = load_mtp_draft(config, parts, model, device, rank)
        draft_bytes = draft.cache_layout().bytes_per_block(config.block_size, dtype)
    pools = cache_blocks_for(config, model.config, dtype, max_len, device, draft_bytes)
    blocks = pools.blocks
    slots = pools.slots or slots_for(model.config, config.max_num_seqs, dtype)
    cache = make_kv_cache(
        model.config,
        blocks,
        config.block_size,
        dtype,
        device,
        slots,
        pools.window_blocks,
        shared_slots=pools.slot_pages > 0,
    )
    window = "" if pools.window_blocks is None else f" (+ {pools.window_blocks} window blocks)"
    log.info(
        "KV cache: %d blocks%s of %d tokens, %s, %d bytes%s",
        blocks,
        window,
        config.block_size,
        str(dtype).removeprefix("torch."),
        cache.bytes,
        f" ({cache.summary})" if cache.summary else "",
    )
    log.info(
        "maximum concurrency for %d tokens per request: %.2fx",
        max_len,
        max_concurrency(blocks, cache.layout.blocks_for(max_len, config.block_size), cache),
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_len,
    )
    # The tokenizer only names the eos token when the config names none; loading it imports
    # transformers, seconds that every rank of every (re)started world would spend otherwise.
    tokenizer = (
        None
        if model.config.eos_token_ids
        else load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
    )
    engine = EngineCore(
        model, tokenizer, cache, scheduler_config, device, prefix_caching, speculative, draft
    )
    # Requests without a seed draw from torch's default generator: seeding it here makes two runs
    # with the same EngineConfig.seed sample alike; data-parallel ranks get distinct streams.
    torch.manual_seed(config.seed + rank)
    memory = MemoryReport(
        "attention",
        rank,
        parameter_bytes(model),
        cache.bytes,
        len(model.expected_tensors()),
        cache_dtype=str(dtype).removeprefix("torch."),
        cache_blocks=blocks,
    )
    return engine, report, memory


def load_half(
    config: EngineConfig, parts: ModelParts, device: torch.device, rank: int = 0
) -> tuple[CausalLM, LoadReport]:
    """One half of the configured model, read or drawn as `config.load_format` says. Every rank
    draws dummy weights from the same `config.seed`: halves equal the colocated model's."""
    return load_model(
        config.model,
        parts,
        config.dtype,
        str(device),
        config.load_format,
        config.seed,
        load_progress(config, rank),
        config.quantization,
    )


def parameter_bytes(model: CausalLM) -> int:
    return sum(t.numel() * t.element_size() for t in model.expected_tensors().values())


def half_parts(role: str, gate_on_attention: bool) -> ModelParts:
    if role == "attention":
        return ModelParts(attention=True, ffn=False, gate_on_attention=gate_on_attention)
    if role == "ffn":
        return ModelParts(attention=False, ffn=True, gate_on_attention=gate_on_attention)
    return ModelParts.colocated(gate_on_attention)
