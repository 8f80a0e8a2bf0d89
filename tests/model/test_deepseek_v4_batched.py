"""DeepSeek-V4's batched path (model/families/deepseek_v4/batched.py) against the per-sequence
path over the same paged cache. Decode: sequences of different lengths decode together for several
steps, so that in one step some close a CSA and/or HCA window (the first window too, and with
fewer closed entries than index_topk) and some do not. Chunks: several sequences' prefill chunks
of lengths around both rates and past the window, starting from 0 or mid-window, beside decodes.
The logits are close to float32 rounding, the tokens equal, and the pages it writes are the ones the
per-sequence path writes (chunks: the slot rings as a resumed chunk reads them). Pad rows (eagerly
padded rows beyond the segments, and the CUDA graph buffers' pad segments with stale block tables
pointing at real sequences' blocks) attend to nothing, write nothing into a real page and stay
finite."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afdserve.engine.cuda_graphs import UbatchBuffers
from afdserve.engine.kv_cache import make_kv_cache
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.model.cache import PagedCache
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families.deepseek_v4 import batched
from afdserve.model.families.deepseek_v4.model import V4CausalLM
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts

CSA, HCA, SLIDING = (
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "sliding_attention",
)
# Context lengths before the first decode step (the tiny V4: CSA rate 2, HCA rate 4, topk 2): 0
# (a first token), 1 (closes CSA's window 0: one entry, below topk), 3 (closes both), 5, 6, 11
# (six CSA entries, more than topk), 12, 17; each step moves every one of them on by one.
LENGTHS = (0, 1, 3, 5, 6, 11, 12, 17)
STEPS = 5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, V4CausalLM]:
    root = tmp_path_factory.mktemp("v4b")
    dirs: dict[str, Path] = {
        # sliding, CSA, HCA, CSA; a hash layer first
        "tiny": make_tiny_model(root / "tiny", "deepseek_v4", hash_layers=1, seed=2),
        # rates 3 and 6, window 3, topk 3, hash layers between
        "r3r6": make_tiny_v4(
            root / "r3r6",
            seed=5,
            hc_mult=3,
            sliding_window=3,
            index_topk=3,
            compress_rates={CSA: 3, HCA: 6},
            layer_types=[CSA, HCA, SLIDING, HCA],
            mlp_layer_types=["moe", "hash_moe", "moe", "hash_moe"],
        ),
    }
    return {name: load_model(d, ModelParts.colocated(), "float32")[0] for name, d in dirs.items()}


def forward(
    model: V4CausalLM, cache: PagedCache, ids: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """The engine's layer loop (engine/model_runner.py, one ubatch) -> logits of every row."""
    h = model.embed(ids)
    residual, ffn_out = h, None
    cos_sin = model.cos_sin(meta.positions)
    for layer in range(model.config.num_layers):
        x, residual = model.attention_half(
            layer, residual, ffn_out, meta, cache.layers[layer], cos_sin
        )
        ffn_out = model.ffn_half(layer, x, ids.clamp(min=0))
    return model.logits(model.add_ffn_output(residual, ffn_out))


def slot_of(table: torch.Tensor) -> int:
    """A test sequence's state slot (where its open compressor rows sit): its first block's
    number, distinct per sequence, so a cache of as many slots as blocks (`v4_cache`) holds
    every sequence's."""
    return int(table[0])


def v4_cache(
    model: V4CausalLM, blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> PagedCache:
    return make_kv_cache(model.config, blocks, block_size, dtype, "cpu", num_slots=blocks)


def tables_for(lengths: tuple[int, ...], block_size: int, width: int) -> torch.Tensor:
    """Distinct blocks for every sequence, scattered over the cache (not in table order)."""
    count = len(lengths) * width
    blocks = torch.randperm(count + 3, generator=torch.Generator().manual_seed(7))[:count]
    return blocks.view(len(lengths), width)


def prefill(
    model: V4CausalLM, cache: PagedCache, prompts: list[torch.Tensor], tables: torch.Tensor
) -> None:
    for prompt, table in zip(prompts, tables, strict=True):
        if len(prompt):
            n = len(prompt)
            meta = AttentionMetadata(
                torch.arange(n),
                torch.zeros(n, dtype=torch.int64),
                (Segment(0, n, table, n, slot_of(table)),),
            )
            forward(model, cache, prompt, meta)


def decode_meta(
    positions: torch.Tensor, tables: torch.Tensor, pad: int, device_meta: bool
) -> AttentionMetadata:
    """One decode row per sequence and `pad` pad rows after them (id 0, position 0, no segment),
    as ModelRunner.prepare lays a padded step out; with or without its device segments."""
    segments = tuple(
        Segment(i, i + 1, tables[i], int(p) + 1, slot_of(tables[i]))
        for i, p in enumerate(positions)
    )
    rows = len(segments) + pad
    full = torch.cat((positions, torch.zeros(pad, dtype=torch.int64)))
    batched_meta = batch_segments(segments, torch.device("cpu")) if device_meta else None
    return AttentionMetadata(full, torch.zeros(rows, dtype=torch.int64), segments, batched_meta)


def pages_close(got: PagedCache, want: PagedCache, rings: bool = True) -> None:
    """Every page (and with `rings` every slot ring) row for row."""
    for layer, (g, w) in enumerate(zip(got.layers, want.layers, strict=True)):
        for name in (*w.pages, *(w.slots if rings else ())):
            # A page sharing its flat buffer with a ring (CSA's first series) alone without.
            mine, theirs = (
                (g.flat[name][:-1], w.flat[name][:-1]) if rings else (g.pages[name], w.pages[name])
            )
            torch.testing.assert_close(
                mine,
                theirs,
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, n=name, i=layer: f"layer {i} {n}: {m}",
            )


def resumed_states_close(
    got: PagedCache, want: PagedCache, tables: torch.Tensor, ends: list[int]
) -> None:
    """What a chunk resuming at each sequence's end reads from its slot rings (the open rows,
    CSA's first series). The batched path also keeps the rows of a chunk's last R positions,
    where a rolled-back speculative step resumes (the per-sequence path takes no drafts)."""
    for g, w in zip(got.layers, want.layers, strict=True):
        if not g.geometry.rate:
            continue
        for table, end in zip(tables, ends, strict=True):
            states = [c.read(table, end, torch.float32, slot_of(table)) for c in (g, w)]
            if states[1] is None:
                continue
            for part in ("compressor", "indexer"):
                mine, theirs = getattr(states[0], part), getattr(states[1], part)
                for field in ("pending_kv", "pending_gate", "prev_kv", "prev_gate"):
                    a, b = getattr(mine, field, None), getattr(theirs, field, None)
                    assert (a is None) == (b is None), (part, field, end)
                    if b is not None:
                        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0.0)


def setup(model: V4CausalLM, block_size: int):
    width = -(-(max(LENGTHS) + STEPS + 1) // block_size)
    tables = tables_for(LENGTHS, block_size, width)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in LENGTHS]
    blocks = int(tables.max()) + 1
    reference = v4_cache(model, blocks, block_size)
    prefill(model, reference, prompts, tables)
    twin = v4_cache(model, blocks, block_size)
    for a, b in zip(twin.layers, reference.layers, strict=True):
        for name in a.flat:
            a.flat[name].copy_(b.flat[name])
    last = torch.randint(0, 256, (len(LENGTHS),), generator=gen)
    return tables, reference, twin, last


def scratch_rows(cache: PagedCache) -> list[torch.Tensor]:
    return [layer.flat[name][-1].clone() for layer in cache.layers for name in layer.flat]


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("shape", ["tiny", "r3r6"])
@pytest.mark.parametrize("pad", [0, 3])
@torch.inference_mode()
def test_batched_decode_equals_the_per_sequence_path(
    models: dict[str, V4CausalLM],
    shape: str,
    block_size: int,
    pad: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = models[shape]
    tables, reference, twin, ids = setup(model, block_size)
    calls = []
    monkeypatch.setattr(batched, "_compressed", _counting(batched._compressed, calls))
    positions = torch.tensor(LENGTHS)
    rates = (model.config.family_config.csa_rate, model.config.family_config.hca_rate)
    closing: dict[int, list[tuple[bool, ...]]] = {rate: [] for rate in rates}
    for _ in range(STEPS):
        for rate in rates:
            closing[rate].append(tuple(((positions + 1) % rate == 0).tolist()))
        step_ids = torch.cat((ids, torch.zeros(pad, dtype=torch.int64)))
        want = forward(model, reference, step_ids, decode_meta(positions, tables, pad, False))
        before = len(calls)
        got = forward(model, twin, step_ids, decode_meta(positions, tables, pad, True))
        assert len(calls) > before  # the batched path ran, the reference did not
        real = len(LENGTHS)
        close(got[:real], want[:real])
        assert got[:real].argmax(-1).tolist() == want[:real].argmax(-1).tolist()
        assert bool(torch.isfinite(got).all())
        pages_close(twin, reference)
        ids, positions = want[:real].argmax(-1), positions + 1
    # Rows that close a window beside rows that do not: CSA's in every step, HCA's in some.
    mixed = {rate: [any(c) and not all(c) for c in steps] for rate, steps in closing.items()}
    assert all(mixed[rates[0]]) and any(mixed[rates[1]])


def _counting(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("block_size", [2, 16])
@torch.inference_mode()
def test_graph_buffers_pad_segments_write_no_real_page(
    models: dict[str, V4CausalLM], block_size: int
) -> None:
    """The static layout a captured graph reads (UbatchBuffers on CPU): no host-side segments,
    a capture size above the batch, pad segments of context 0 whose block tables are left over
    from a larger batch, i.e. point at the real sequences' blocks, at positions that would close
    every window."""
    model = models["tiny"]
    tables, reference, twin, ids = setup(model, block_size)
    real, size = len(LENGTHS), len(LENGTHS) + 4
    # The graph's tables are wider than any sequence's (max_model_len's blocks): the columns past
    # a real sequence's blocks keep a larger batch's, other sequences' blocks too.
    width = tables.shape[1] + 3
    buffers = UbatchBuffers(size, width, torch.device("cpu"))
    wide = torch.cat((tables, tables.roll(1, 0)[:, :3]), dim=1)
    stale = tuple(
        Segment(i, i + 1, wide[i % real], 8, slot_of(wide[i % real])) for i in range(size)
    )
    buffers.load(batch_segments(stale, torch.device("cpu")), size, size)
    positions = torch.tensor(LENGTHS)
    for _ in range(3):
        want = forward(model, reference, ids, decode_meta(positions, tables, 0, False))
        segments = decode_meta(positions, tables, 0, True).batched
        buffers.load(segments, size, real)
        pad_positions = torch.full((size - real,), 7)  # (7 + 1) % 4 == 0: every window closes
        graph_meta = AttentionMetadata(
            torch.cat((positions, pad_positions)),
            torch.full((size,), -1),
            (),
            buffers.batched(size, 1, width * block_size),
        )
        step_ids = torch.cat((ids, torch.zeros(size - real, dtype=torch.int64)))
        got = forward(model, twin, step_ids, graph_meta)
        close(got[:real], want[:real])
        assert bool(torch.isfinite(got).all())
        pages_close(twin, reference)  # the pad rows wrote only the scratch rows
        ids, positions = want.argmax(-1), positions + 1
    assert any(bool(row.abs().sum() > 0) for row in scratch_rows(twin))


def chunk_lengths(model: V4CausalLM) -> list[int]:
    """Chunk lengths around the compress rates m (CSA) and M (HCA) and past the window: each
    closes no window, one, or several, and a chunk starting where the last one ended starts
    mid-window."""
    v4 = model.config.family_config
    m, big, window = v4.csa_rate, v4.hca_rate, v4.sliding_window
    return [m - 1, m, m + 1, 1, 2 * m + 3, big - 1, 1, big + 1, 2 * big + 3, window + 5]


def step_meta(
    chunks: list[tuple[torch.Tensor, int, int]], pad: int, device_meta: bool, host: bool
) -> AttentionMetadata:
    """One step: per sequence (table, start, rows) its rows [start, start + rows), the segments
    in order, then `pad` pad rows (position 0, no segment); device segments or not, host-side
    segments or not (a graph's static layout has none)."""
    segments, positions, row = [], [], 0
    for table, start, n in chunks:
        segments.append(Segment(row, row + n, table, start + n, slot_of(table)))
        positions.append(torch.arange(start, start + n))
        row += n
    positions.append(torch.zeros(pad, dtype=torch.int64))
    device = batch_segments(tuple(segments), torch.device("cpu")) if device_meta else None
    slots = torch.zeros(row + pad, dtype=torch.int64)
    return AttentionMetadata(torch.cat(positions), slots, tuple(segments) if host else (), device)


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("shape", ["tiny", "r3r6"])
@pytest.mark.parametrize(("pad", "host"), [(0, True), (3, True), (2, False)])
@torch.inference_mode()
def test_batched_chunks_equal_the_per_sequence_path(
    models: dict[str, V4CausalLM],
    shape: str,
    block_size: int,
    pad: int,
    host: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps of several sequences' chunks (prefills from position 0, chunks starting mid-window
    and closing several CSA and HCA windows, chunks longer than the window, decodes beside
    them) run at once and give the per-sequence path's logits and pages, step after step."""
    model = models[shape]
    lengths = chunk_lengths(model)
    sequences, steps = 6, 4
    total = max(lengths) * steps
    tables = tables_for((0,) * sequences, block_size, -(-total // block_size))
    blocks = int(tables.max()) + 1
    reference = v4_cache(model, blocks, block_size)
    twin = v4_cache(model, blocks, block_size)
    calls = []
    monkeypatch.setattr(batched, "_compressed", _counting(batched._compressed, calls))
    gen = torch.Generator().manual_seed(3)
    done = [0] * sequences
    for step in range(steps):
        # Sequence 0 alone in the first step (one prefill from 0), all of them after.
        chunks = [
            (tables[i], done[i], lengths[(3 * i + step) % len(lengths)])
            for i in range(1 if step == 0 else sequences)
        ]
        real = sum(n for _, _, n in chunks)
        ids = torch.cat((torch.randint(0, 256, (real,), generator=gen), torch.zeros(pad).long()))
        want = forward(model, reference, ids, step_meta(chunks, pad, False, True))
        before = len(calls)
        got = forward(model, twin, ids, step_meta(chunks, pad, True, host))
        assert len(calls) > before  # the batched path ran, the reference did not
        close(got[:real], want[:real])
        assert bool(torch.isfinite(got).all())
        pages_close(twin, reference, rings=False)
        for table, start, n in chunks:
            done[int((tables == table).all(1).nonzero())] = start + n
        resumed_states_close(twin, reference, tables, done)


@torch.inference_mode()
def test_pad_rows_give_zero_attention_and_write_no_real_page(
    models: dict[str, V4CausalLM],
) -> None:
    """Pad rows beside a prefill chunk: every layer's attention output is zero on them (as on
    the per-sequence path), and the pages are those of the prefill alone."""
    model = models["tiny"]
    tables = tables_for((0, 0), 4, 4)
    blocks = int(tables.max()) + 1
    padded_cache = v4_cache(model, blocks, 4)
    alone = v4_cache(model, blocks, 4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (9,), generator=gen)
    forward(model, alone, ids, step_meta([(tables[0], 0, 9)], 0, True, True))
    padded = step_meta([(tables[0], 0, 9)], 5, True, True)
    forward(model, padded_cache, torch.cat((ids, torch.zeros(5).long())), padded)
    pages_close(padded_cache, alone)
    rows, ropes = batched.StepRows.of(padded), model.ropes("cpu")
    x = torch.randn(14, model.config.hidden_size, generator=gen)
    for layer, pages in enumerate(padded_cache.layers):
        attn = model.model.layers[layer].self_attn
        own = ropes["main"] if attn.kind == SLIDING else ropes["compress"]
        y = batched.step_attention(attn, pages, x, rows, own, ropes["compress"])
        assert bool((y[9:] == 0).all()) and bool(y[:9].abs().sum() > 0)


@pytest.mark.parametrize("block_size", [2, 16])
@pytest.mark.parametrize("shape", ["tiny", "r3r6"])
@torch.inference_mode()
def test_full_graph_layout_mixed_steps_equal_the_per_sequence_path(
    models: dict[str, V4CausalLM], shape: str, block_size: int
) -> None:
    """What a `full` graph replays (cuda_graphs.UbatchBuffers on CPU): prefill chunks beside
    decodes, then a step of decodes alone, from the static buffers only: no host segments,
    tables as wide as max_model_len whose columns past each sequence's blocks (and whose pad
    segments) keep an earlier, larger step's blocks, pad rows at positions that close every
    window, and a query length of the whole capture size (so decode-only steps run the mixed
    path too). Logits, tokens and pages are the per-sequence path's (the slot rings as a
    resumed chunk reads them)."""
    model = models[shape]
    lengths = chunk_lengths(model)
    sequences, steps = 5, 4
    span = -(-max(lengths) * steps // block_size)
    tables = tables_for((0,) * sequences, block_size, span)
    blocks = int(tables.max()) + 1
    reference, twin = v4_cache(model, blocks, block_size), v4_cache(model, blocks, block_size)
    size, width = sequences * max(lengths) + 3, span + 3  # capture size, max_model_len's
    buffers = UbatchBuffers(size, width, torch.device("cpu"))
    wide = torch.cat((tables, tables.roll(1, 0)[:, :3]), dim=1)
    stale = tuple(
        Segment(i, i + 1, wide[i % sequences], 9, int(wide[i % sequences][0])) for i in range(size)
    )
    buffers.load(batch_segments(stale, torch.device("cpu")), size, size)
    gen = torch.Generator().manual_seed(5)
    done = [0] * sequences
    for step in range(steps + 1):
        decode_only = step == steps
        chunks = [
            (tables[i], done[i], 1 if decode_only else lengths[(2 * i + step) % len(lengths)])
            for i in range(sequences if step else 2)
        ]
        real = sum(n for _, _, n in chunks)
        ids = torch.randint(0, 256, (real,), generator=gen)
        want = forward(model, reference, ids, step_meta(chunks, 0, False, True))
        buffers.load(step_meta(chunks, 0, True, False).batched, size, real)
        pad_positions = torch.full((size - real,), 7)  # closes every window of rates 2, 4, 8
        graph_meta = AttentionMetadata(
            torch.cat((step_meta(chunks, 0, False, True).positions, pad_positions)),
            torch.full((size,), -1),
            (),
            buffers.batched(size, size, width * block_size),
        )
        assert not batched.StepRows.of(graph_meta).decode
        step_ids = torch.cat((ids, torch.zeros(size - real, dtype=torch.int64)))
        got = forward(model, twin, step_ids, graph_meta)
        close(got[:real], want[:real])
        assert got[:real].argmax(-1).tolist() == want.argmax(-1).tolist()
        assert bool(torch.isfinite(got).all())
        pages_close(twin, reference, rings=False)
        for i, (_, start, n) in enumerate(chunks):
            done[i] = start + n
        resumed_states_close(twin, reference, tables, done)
