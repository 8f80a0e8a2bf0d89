"""Count the launches of DeepSeek-V4's attention half per layer, on a CPU: the tiny V4 runs a
decode ubatch and a mixed one (prefill chunks beside decodes) through the engine's layer loop with
the CUDA dispatch of kernels/ops.py (every Triton fast path taken, run by Triton's interpreter),
and each layer's launches are counted: the Triton kernels, and the torch operators that launch a
kernel on a GPU (views and no-op casts excluded). What a ubatch builds once for all its layers
(the rows, their addresses and rotary tables: rows.py) is counted apart, so a layer's count is
what every later layer of its type launches. A GPU profile (tools/profile_decode.py) counts the
same launches plus the GEMM library's; this needs no GPU.

    PYTHONPATH=. python tools/v4_launches.py [--verbose]
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit function is defined

import argparse  # noqa: E402
import collections  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from afdserve.engine.kv_cache import make_kv_cache  # noqa: E402
from afdserve.kernels import ops  # noqa: E402
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments  # noqa: E402
from afdserve.model.checkpoint.loader import load_model  # noqa: E402
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4  # noqa: E402
from afdserve.model.parts import ModelParts  # noqa: E402

# Operators that launch nothing on a GPU (views, metadata, allocation without a fill).
NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "select", "slice",
    "as_strided", "t", "transpose", "permute", "detach", "alias", "unbind", "split",
    "split_with_sizes", "chunk", "narrow", "lift_fresh", "empty", "empty_like", "new_empty",
    "empty_strided", "unflatten", "flatten", "_reshape_alias", "diagonal", "movedim",
    "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "item",
    "scalar_tensor",
}  # fmt: skip
CASTS = {"to", "_to_copy", "contiguous", "clone"}


class Launches(TorchDispatchMode):
    """Counts the operators that launch, by name and by the project's line that called them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.where: collections.Counter[str] = collections.Counter()
        self.triton: collections.Counter[str] = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.paused or name in NO_LAUNCH or (name in CASTS and _same(out, args)):
            return out
        self.ops[name] += 1
        frames = [f for f in traceback.extract_stack() if "afdserve" in f.filename]
        if frames:
            f = frames[-1]
            self.where[f"{f.filename.split('afdserve/')[-1]}:{f.lineno} {name}"] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + sum(self.triton.values())


def _same(out, args) -> bool:
    """A cast or copy that returns its input's memory as it was (no kernel on a GPU)."""
    for a in args:
        if isinstance(a, torch.Tensor) and isinstance(out, torch.Tensor) and a.numel():
            if a.data_ptr() == out.data_ptr() and a.dtype == out.dtype and a.shape == out.shape:
                return True
    return False


def count_triton(mode: list[Launches | None]) -> None:
    """Count every interpreted kernel launch into the active counter, not its operators."""
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        active = mode[0]
        if active is None:
            return run(self, *args, **kwargs)
        active.triton[self.fn.__name__] += 1
        active.paused = True
        try:
            return run(self, *args, **kwargs)
        finally:
            active.paused = False

    interpreter.InterpretedFunction.run = counted


def meta_of(positions: list[int], segments: list[Segment]) -> AttentionMetadata:
    p = torch.tensor(positions)
    device = torch.device("cpu")
    batched = batch_segments(tuple(segments), device)
    return AttentionMetadata(p, torch.zeros_like(p), tuple(segments), batched)


def steps() -> list[tuple[str, list[int], list[Segment], int]]:
    """(name, positions, segments, rows) of a prefill step, then a mixed and a decode one over
    four sequences (tables: 8 blocks of 4 each, slot i), two pad rows each."""
    tables = torch.randperm(32, generator=torch.Generator().manual_seed(4)).view(4, 8)

    def seg(row, rows, i, context):
        return Segment(row, row + rows, tables[i], context, i)

    prefill = [seg(0, 5, 0, 5), seg(5, 9, 1, 9)]
    mixed = [seg(0, 1, 0, 6), seg(1, 1, 1, 10), seg(2, 6, 2, 6), seg(8, 8, 3, 8)]
    decode = [seg(i, 1, i, c) for i, c in enumerate((7, 11, 7, 9))]
    return [
        ("prefill", list(range(5)) + list(range(9)), prefill, 14),
        ("mixed", [5, 9, *range(6), *range(8), 0, 0], mixed, 18),
        ("decode", [6, 10, 6, 8, 0, 0], decode, 6),
    ]


def main(argv: list[str] | None = None) -> dict[str, dict[str, int]]:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--verbose", action="store_true", help="each layer's launches by line")
    verbose = args.parse_args(argv).verbose
    ops._triton_ready = lambda t: True  # CUDA's dispatch, on CPU tensors (interpreted)
    active: list[Launches | None] = [None]
    count_triton(active)
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as root:
        # Each attention type twice: the second of a type launches only its own work.
        types = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
        path = make_tiny_v4(
            Path(root) / "tiny",
            seed=2,
            num_hidden_layers=6,
            layer_types=types * 2,
            mlp_layer_types=["hash_moe"] + ["moe"] * 5,
        )
        model = load_model(path, ModelParts.colocated(), "float32")[0]
    cache = make_kv_cache(model.config, 32, 4, torch.float32, "cpu", num_slots=4)
    kinds = [layer.self_attn.kind for layer in model.model.layers]
    gen = torch.Generator().manual_seed(1)
    result: dict[str, dict[str, int]] = {}
    for name, positions, segments, rows in steps():
        ids = torch.randint(0, 256, (rows,), generator=gen)
        per_ubatch = Launches()
        active[0] = per_ubatch
        with per_ubatch:
            meta = cache.layout.with_step_metadata(meta_of(positions, segments))
        residual, ffn_out = model.embed(ids), None
        cos_sin = model.cos_sin(meta.positions)
        layers: dict[str, list[int]] = collections.defaultdict(list)
        for layer, kind in enumerate(kinds):
            counter = Launches()
            active[0] = counter
            with counter:
                x, residual = model.attention_half(
                    layer, residual, ffn_out, meta, cache.layers[layer], cos_sin
                )
            active[0] = None
            layers[kind].append(counter.total)
            if verbose:
                print(f"{name} layer {layer} {kind}: {counter.total}")
                for where, n in sorted(counter.where.items()):
                    print(f"    {n:3d} {where}")
                print(f"    triton {dict(counter.triton)}")
            ffn_out = model.ffn_half(layer, x, ids)
        # A type's first layer also makes what the ubatch shares; its later ones do not.
        result[name] = {kind: min(counts) for kind, counts in layers.items()}
        shared = sum(max(c) - min(c) for c in layers.values()) + per_ubatch.total
        result[name]["per ubatch"] = shared
        row = ", ".join(f"{kind} {n}" for kind, n in result[name].items())
        print(f"{name}: launches a layer: {row}")
    return result


if __name__ == "__main__":
    main()
