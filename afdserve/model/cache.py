"""The cache interface between a model family and the engine: the state a family's layers keep
per sequence, in pages of the engine's blocks or in one fixed-size slot per sequence.

The engine gives every sequence one block table (block b covers positions [b B, (b + 1) B)),
where a layout holds windowed specs (`CacheSpec.window`) a second table over those layers' own
pool, whose blocks behind the window it frees (a layer may keep part of its state there and
part in the main pages: `CacheSpec.join`), and where it holds `SequenceSlots` specs one
state slot. Each group of layers describes its
state with a `CacheSpec`; a model's specs form its `CacheLayout`, which the block manager, the
memory budget, prefix caching, the FP8 check, the CUDA-graph policy and the model runner read.
None of them asks which family it runs (vLLM v1's `KVCacheSpec` per layer group is the model of
this seam). `PagedKV` is the plain paged cache of GQA keys and values or MLA's latent;
DeepSeek-V4's pages are in model/families/deepseek_v4/cache.py (with a slot per sequence beside
them: `CacheSpec.bytes_per_slot`); a linear-attention layer's recurrent state is a
`SequenceSlots` spec (model/families/gated_deltanet/cache.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.slot_plan import Part, SlotPlan, pack, part_bytes, views

GRAPH_MODES = ("none", "full_decode_only", "full")


class CacheSpec(ABC):
    """One group of layers whose per-sequence state has the same page geometry."""

    kind: str  # its name in the start-up line ("KV", "sliding", "CSA", ...)
    layers: tuple[int, ...]
    # Why the pages cannot be stored as float8_e4m3fn (None: they can, at scale 1.0).
    fp8_refusal: str | None = None
    # (graph mode, why the layers cannot be captured in it on CUDA).
    graph_refusals: tuple[tuple[str, str], ...] = ()
    # Why graph_mode "auto" stays "none" on CUDA for these layers (None: the engine's default).
    eager_by_default: str | None = None
    # (max_model_len above which "auto" stays "none" on CUDA, why): for layers whose captured
    # decode reads every row's state out to max_model_len, so that a graph's cost grows with it.
    graph_context_limit: tuple[int, str] | None = None
    # Whether the layers read the batched segment tensors on every device (the CPU reference
    # otherwise loops over segments).
    batched_segments: bool = False
    # Why rows a step wrote past what a sequence keeps (a speculative step's rejected drafts)
    # cannot be left to be overwritten (None: a position's state sits at that position alone).
    rollback_refusal: str | None = None
    # (the most draft rows a step may write past what a sequence keeps and take back, why): for
    # a cache that keeps recent rows in a fixed-size ring (None: any number).
    draft_limit: tuple[int, str] | None = None
    # A sliding window's width: a query at p reads only positions p - window < j <= p, so the
    # engine keeps these layers' pages in a pool of their own, through a second block table
    # per sequence whose blocks it frees once they fall out of the window (None: every page
    # of the sequence stays read). A windowed spec may cover layers that another, unwindowed
    # spec covers too: those layers keep part of their state in each pool (`join`).
    window: int | None = None

    @abstractmethod
    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one layer of the group holds per block."""

    @abstractmethod
    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> list[Any]:
        """One layer cache per layer of the group, over `num_blocks` blocks (and, where
        `bytes_per_slot` is not 0, a `num_slots` keyword: the sequence slots beside them)."""

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes one layer of the group holds per sequence slot beside its pages: state of a
        fixed size per sequence (DeepSeek-V4's open compressor rows). 0: none."""
        return 0

    def page_rows(self, block_size: int, dtype: torch.dtype) -> tuple[int, ...] | None:
        """Bytes per block of each tensor of one layer's cache, where each is a contiguous
        `[blocks, ...]` tensor whose pages may lend their bytes to state slots
        (`CacheLayout.slot_pages`); None: its pages lend nothing."""
        return None

    @staticmethod
    def tensors(layer_cache: Any) -> Iterator[torch.Tensor]:
        """Every tensor of one layer's cache (the benches fill them)."""
        yield from (t for t in layer_cache if t is not None)

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        return -(-num_tokens // block_size)

    def join(self, layer_cache: Any, window_cache: Any) -> Any:
        """One layer's cache from this spec's part and a windowed spec's (`window_cache`, in
        the window pool) where both cover the layer: the layer then reads the main view, whose
        `AttentionMetadata.window` addresses the windowed part."""
        raise TypeError(f"{type(self).__name__} keeps no part of a layer in a windowed pool")

    def prefix_reuse_refusal(self, block_size: int) -> str | None:
        """Why a full block's pages cannot be reused by its prefix hash at this block size
        (None: they can: once full, a block's pages depend on the tokens up to its end and on
        nothing else, and nothing writes them again)."""
        return None

    # Whether every spec of this type builds the same step metadata (what it builds depends on
    # the ubatch alone, not on the spec's layers): the layout then asks the first of them.
    step_metadata_per_type: bool = False

    def step_metadata(self, meta: AttentionMetadata) -> Any:
        """What the group's layers read of one ubatch beyond `meta`, built once per ubatch
        and shared by every layer of the group (None: nothing). Device ops on `meta.batched`
        only, no host sync, shapes from the segment tensors' sizes: under CUDA graphs it is
        captured with the layers and rebuilt by every replay from the refilled buffers."""
        return None


class SequenceSlots(CacheSpec):
    """A group of layers whose state per sequence has a fixed size, whatever its length (a
    linear-attention layer's recurrent state and convolution window): one slot per running
    sequence, none per block. Each layer's state is a few parts, `[slots + 1, ...]` tensors
    whose last slot is a scratch no sequence holds (where a torch step sends the writes of pad
    entries). The engine gives a sequence its slot with its first blocks and takes it back with
    them; a layer starts from an empty state wherever a segment starts at position 0, so a slot
    needs no zeroing when it changes hands (and a sequence preempted by recompute starts
    afresh). The parts are tensors of their own, or views into the pages of the paged groups
    (`CacheLayout.slot_pages`): then a slot's stride is not its size, and kernels read it."""

    rollback_refusal = (
        "a recurrent state folds in every row it is fed, so rejected drafts cannot be taken "
        "back out of it"
    )

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 0

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        return 0

    def allocate(self, num_blocks, block_size, dtype, device) -> list[Any]:
        raise TypeError(f"{type(self).__name__} holds slots, not blocks: use allocate_slots")

    @abstractmethod
    def slot_parts(self, dtype: torch.dtype) -> tuple[Part, ...]:
        """(shape, dtype) of each part of one layer's state per slot."""

    @abstractmethod
    def layer_cache(self, parts: tuple[torch.Tensor, ...]) -> Any:
        """One layer's cache from its parts, each `[slots + 1, *shape]` (the last: scratch)."""

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes one layer of the group holds per sequence slot."""
        return sum(torch.Size(shape).numel() * dt.itemsize for shape, dt in self.slot_parts(dtype))

    def allocate_slots(
        self, num_slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> list[Any]:
        """One layer cache per layer of the group, over `num_slots` slots of their own."""
        parts = self.slot_parts(dtype)
        return [
            self.layer_cache(
                tuple(
                    torch.zeros(num_slots + 1, *shape, dtype=dt, device=device)
                    for shape, dt in parts
                )
            )
            for _ in self.layers
        ]


@dataclass(frozen=True)
class PagedKV(CacheSpec):
    """Per layer `[num_blocks, block_size, heads, dim]`: keys and values (GQA), or one latent
    (MLA: `tensors=1`). Its layer cache is the pair (keys, values or None)."""

    layers: tuple[int, ...]
    heads: int
    dim: int
    tensors_per_layer: int = 2
    kind: str = "KV"

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return self.tensors_per_layer * block_size * self.heads * self.dim * dtype.itemsize

    def page_rows(self, block_size: int, dtype: torch.dtype) -> tuple[int, ...] | None:
        return (block_size * self.heads * self.dim * dtype.itemsize,) * self.tensors_per_layer

    def allocate(self, num_blocks, block_size, dtype, device) -> list[Any]:
        shape = (num_blocks, block_size, self.heads, self.dim)

        def one() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return [(one(), one() if self.tensors_per_layer == 2 else None) for _ in self.layers]


@dataclass(frozen=True)
class CacheLayout:
    """A model's specs, one per group of layers; every layer in exactly one group."""

    specs: tuple[CacheSpec, ...]
    num_layers: int

    def __post_init__(self) -> None:
        every = list(range(self.num_layers))
        for windowed in (False, True):
            part = sorted(
                i for s in self.specs if (s.window is not None) == windowed for i in s.layers
            )
            if len(set(part)) != len(part) or not set(part) <= set(every):
                which = "windowed" if windowed else "unwindowed"
                raise ValueError(f"{which} cache specs cover layers {part}: each at most once")
        covered = {i for spec in self.specs for i in spec.layers}
        if sorted(covered) != every:
            raise ValueError(f"cache specs cover layers {sorted(covered)}, not 0..{len(every) - 1}")

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes every layer holds per block (the windowed groups' pages included)."""
        return sum(len(s.layers) * s.bytes_per_block(block_size, dtype) for s in self.specs)

    @property
    def window(self) -> int | None:
        """The widest window of the windowed groups, which share one pool of pages and one
        second block table per sequence (None: the layout has no windowed group)."""
        return max((s.window for s in self.specs if s.window is not None), default=None)

    def bytes_per_window_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes the windowed groups' layers hold per block of their own pool."""
        specs = (s for s in self.specs if s.window is not None)
        return sum(len(s.layers) * s.bytes_per_block(block_size, dtype) for s in specs)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes every layer holds per sequence slot (0: the layout needs no slots)."""
        return sum(len(s.layers) * s.bytes_per_slot(dtype) for s in self.specs)

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        return max(s.blocks_for(num_tokens, block_size) for s in self.specs)

    def slot_plan(self, block_size: int, dtype: torch.dtype) -> SlotPlan | None:
        """How the `SequenceSlots` specs' state fits the pages of the paged groups
        (model/slot_plan.py), or None where it cannot: no such state, a windowed or
        slot-keeping paged group, or page rows of unequal sizes."""
        parts = self._slot_parts(dtype)
        if not any(part_bytes(p) for p in parts):
            return None
        rows: list[int] = []
        for spec in self.specs:
            if isinstance(spec, SequenceSlots):
                continue
            per = spec.page_rows(block_size, dtype)
            if per is None or spec.window is not None or spec.bytes_per_slot(dtype):
                return None
            rows += list(per) * len(spec.layers)
        if len(set(rows)) != 1:
            return None
        return pack(len(rows), rows[0], parts)

    def _slot_parts(self, dtype: torch.dtype) -> list[Part]:
        """Every part of every slot layer, in order: spec, layer, part."""
        return [
            part
            for spec in self.specs
            if isinstance(spec, SequenceSlots)
            for _ in spec.layers
            for part in spec.slot_parts(dtype)
        ]

    def slot_pages(self, block_size: int, dtype: torch.dtype) -> int:
        """Blocks one sequence slot takes of the pool when the slots share the pages (0: they
        cannot, and take bytes of their own)."""
        plan = self.slot_plan(block_size, dtype)
        return 0 if plan is None else plan.pages

    def _first(self, reasons) -> str | None:
        return next((r for r in reasons if r is not None), None)

    def prefix_reuse_refusal(self, block_size: int) -> str | None:
        return self._first(s.prefix_reuse_refusal(block_size) for s in self.specs)

    @property
    def fp8_refusal(self) -> str | None:
        return self._first(s.fp8_refusal for s in self.specs)

    @property
    def rollback_refusal(self) -> str | None:
        return self._first(s.rollback_refusal for s in self.specs)

    def draft_refusal(self, num_draft_tokens: int) -> str | None:
        """Why a step cannot take `num_draft_tokens` drafts back (None: it can)."""
        return self._first(
            f"num_speculative_tokens={num_draft_tokens} > {limit}: {why}"
            for s in self.specs
            if s.draft_limit is not None
            for limit, why in (s.draft_limit,)
            if num_draft_tokens > limit
        )

    def eager_by_default(self, max_model_len: int) -> str | None:
        """Why graph_mode "auto" stays "none" on CUDA for this model at this max_model_len."""
        over = (
            f"max_model_len={max_model_len} > {limit}: {why}"
            for s in self.specs
            if s.graph_context_limit is not None
            for limit, why in (s.graph_context_limit,)
            if max_model_len > limit
        )
        return self._first((*(s.eager_by_default for s in self.specs), *over))

    @property
    def batched_segments(self) -> bool:
        return any(s.batched_segments for s in self.specs)

    def with_step_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """`meta` with what each spec builds of the ubatch for its layers (`step`)."""
        asked: set[type] = set()
        built = []
        for spec in self.specs:
            if spec.step_metadata_per_type:
                if type(spec) in asked:
                    continue
                asked.add(type(spec))
            if (step := spec.step_metadata(meta)) is not None:
                built.append(step)
        return replace(meta, step=tuple(built)) if built else meta

    def graph_refusal(self, graph_mode: str) -> str | None:
        return self._first(
            why for s in self.specs for mode, why in s.graph_refusals if mode == graph_mode
        )

    def describe(self, block_size: int, dtype: torch.dtype) -> str | None:
        """The start-up line's bytes per block of each group, where there are several kinds."""
        if len({s.kind for s in self.specs}) < 2:
            return None
        parts = [
            f"{len(s.layers)} {s.kind} x {s.bytes_per_block(block_size, dtype)} B"
            for s in self.specs
            if not isinstance(s, SequenceSlots)
        ]
        line = "per block: " + ", ".join(parts)
        slots = [
            f"{len(s.layers)} {s.kind} x {s.bytes_per_slot(dtype)} B"
            for s in self.specs
            if s.bytes_per_slot(dtype)
        ]
        return line + ("; per sequence: " + ", ".join(slots) if slots else "")

    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_slots: int = 0,
        num_window_blocks: int | None = None,
        shared_slots: bool = False,
    ) -> PagedCache:
        """`num_slots`: sequence slots of the `SequenceSlots` specs; required where the layout
        has such specs. `shared_slots`: those slots live in the pages of the last
        `num_slots * slot_pages` blocks (`slot_plan`), which the block manager then hands out
        as blocks or as slots, never both; otherwise in tensors of their own.
        `num_window_blocks`: the windowed groups' own pool, which the engine addresses through
        a second block table (None: they hold `num_blocks` pages addressed by the one table, as
        a bench's fixed tables do)."""
        if num_slots < 1 and self.bytes_per_slot(dtype):
            raise ValueError(f"num_slots={num_slots}: this cache layout needs >= 1 state slot")
        plan = self.slot_plan(block_size, dtype) if shared_slots else None
        if shared_slots and (plan is None or num_slots * plan.pages > num_blocks):
            raise ValueError(
                f"shared_slots: {num_slots} slots of {self.slot_pages(block_size, dtype)} "
                f"blocks cannot live in {num_blocks} blocks of this layout's pages"
            )
        pages = num_blocks + (plan.pages if plan is not None else 0)  # + the slots' scratch
        layers: list[Any] = [None] * self.num_layers
        windowed: dict[int, Any] = {}
        rows: list[torch.Tensor] = []
        for spec in self.specs:
            if isinstance(spec, SequenceSlots):
                if plan is not None:
                    continue  # carved out of the rows below
                caches = spec.allocate_slots(num_slots, dtype, device)
            elif num_window_blocks is not None and spec.window is not None:
                caches = spec.allocate(num_window_blocks, block_size, dtype, device)
            elif spec.bytes_per_slot(dtype):  # pages and a slot per sequence beside them
                caches = spec.allocate(num_blocks, block_size, dtype, device, num_slots=num_slots)
            else:
                caches = spec.allocate(pages, block_size, dtype, device)
                if plan is not None:
                    rows += [t for cache in caches for t in spec.tensors(cache)]
            for i, cache in zip(spec.layers, caches, strict=True):
                if spec.window is not None:
                    windowed[i] = cache
                else:
                    layers[i] = cache
        if plan is not None:
            for i, cache in self._slot_views(plan, rows, num_blocks, num_slots, dtype):
                layers[i] = cache
        for spec in self.specs:
            for i in spec.layers if spec.window is None else ():
                if i in windowed:
                    layers[i] = spec.join(layers[i], windowed.pop(i))
        for i, cache in windowed.items():  # layers whose state is all windowed
            layers[i] = cache
        slots = num_slots if self.bytes_per_slot(dtype) else 0
        if self.window is None:
            num_window_blocks = None
        slot_pages = 0 if plan is None else plan.pages
        return PagedCache(
            self, layers, num_blocks, block_size, dtype, slots, num_window_blocks, slot_pages
        )

    def _slot_views(
        self,
        plan: SlotPlan,
        rows: list[torch.Tensor],
        num_blocks: int,
        num_slots: int,
        dtype: torch.dtype,
    ) -> Iterator[tuple[int, Any]]:
        """(layer, its cache) of every slot layer, its parts views into the rows."""
        parts = iter(views(plan, rows, self._slot_parts(dtype), num_blocks, num_slots))
        for spec in self.specs:
            if isinstance(spec, SequenceSlots):
                for i in spec.layers:
                    count = len(spec.slot_parts(dtype))
                    yield i, spec.layer_cache(tuple(next(parts) for _ in range(count)))


class PagedCache:
    """One attention rank's cache: `layers[i]` is what layer i's attention reads and writes."""

    def __init__(
        self,
        layout: CacheLayout,
        layers: list[Any],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        num_slots: int = 0,
        num_window_blocks: int | None = None,
        slot_pages: int = 0,
    ) -> None:
        self.layout, self.layers = layout, layers
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.num_slots = num_slots  # sequence slots (0: the layout keeps no state per sequence)
        # Blocks a slot takes of the pool where the slots live in the pages (0: in their own
        # tensors); the pages then run `slot_pages` past num_blocks (the slots' scratch).
        self.slot_pages = slot_pages
        # The windowed groups' own pool (None: they share the blocks and the one table).
        self.num_window_blocks = num_window_blocks
        # Whether each sequence has a window table (`AttentionMetadata.window`), and the layers
        # that read through it alone (a layer also in an unwindowed spec reads the main view,
        # beside which the window's rides).
        self.has_window_pool = num_window_blocks is not None
        windowed = {i for s in layout.specs if s.window is not None for i in s.layers}
        paged = {i for s in layout.specs if s.window is None for i in s.layers}
        self.window_layers = frozenset(windowed - paged if self.has_window_pool else ())
        per_block = layout.bytes_per_block(block_size, dtype)
        window_bytes = 0
        if num_window_blocks is not None:
            per_window = layout.bytes_per_window_block(block_size, dtype)
            per_block -= per_window
            window_bytes = per_window * num_window_blocks
        own_slots = 0 if slot_pages else layout.bytes_per_slot(dtype) * num_slots
        self.bytes = per_block * (num_blocks + slot_pages) + window_bytes + own_slots
        self.summary = layout.describe(block_size, dtype)
        if slot_pages and self.summary is not None:
            self.summary += f" (in the pages: {slot_pages} blocks a held slot)"

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache, layer by layer."""
        # A layer in two specs: its unwindowed spec's (the joined cache's) tensors.
        order = sorted(self.layout.specs, key=lambda s: s.window is None)
        spec_of = {i: spec for spec in order for i in spec.layers}
        return [t for i, cache in enumerate(self.layers) for t in spec_of[i].tensors(cache)]
