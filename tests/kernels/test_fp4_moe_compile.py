"""The FP4 expert kernels (kernels/moe/fp4_decode.py) compile for the H200 (sm_90) down to a
cubin, on any machine with Triton: no GPU needed, so a CPU run catches a kernel that would not
build before the GPU run does. Their numbers are tests/gpu/test_fp4_moe.py's (and, on CPU,
tests/kernels/test_fp4_kernel_interpret.py's)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

H200 = ("cuda", 90, 32)
GATE_UP = {
    "x_ptr": "*bf16",
    "ids_ptr": "*i64",
    "w_ptr": "*i32",
    "s_ptr": "*u8",
    "h_ptr": "*bf16",
    "part_ptr": "*fp32",
    "count_ptr": "*i32",
    "num_pairs": "i32",
    "top_k": "i32",
    "hidden": "i32",
    "inter": "i32",
    "w_row": "i32",
    "s_row": "i32",
    "k_per_split": "i32",
    "limit": "fp32",
}
DOWN = {
    "h_ptr": "*bf16",
    "ids_ptr": "*i64",
    "weights_ptr": "*fp32",
    "w_ptr": "*i32",
    "s_ptr": "*u8",
    "y_ptr": "*fp32",
    "part_ptr": "*fp32",
    "count_ptr": "*i32",
    "num_pairs": "i32",
    "hidden": "i32",
    "inter": "i32",
    "w_row": "i32",
    "s_row": "i32",
    "k_per_split": "i32",
}
# What a launch at DeepSeek-V4-Flash's shape specializes as multiples of 16: the pointers (torch's
# allocations) and the dims and row strides (4096, 2048, their / 8 and / 32); not top_k (6).
ALIGNED = {
    "x_ptr",
    "ids_ptr",
    "w_ptr",
    "s_ptr",
    "h_ptr",
    "part_ptr",
    "count_ptr",
    "weights_ptr",
    "y_ptr",
    "hidden",
    "inter",
    "w_row",
    "s_row",
}


def compile_for_h200(kernel, signature: dict, constants: dict, options: dict) -> object:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {
        (kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED & {*signature}
    }
    signature = {**signature, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*H200), options=options)


def compile_tiles(
    tiles,
    by_expert: bool = True,
    hidden: int = 4096,
    inter: int = 2048,
    pairs_pad: int | None = None,
) -> tuple[object, object]:
    """Both kernels at one tile shape, with a launch's constants at Flash's shape (or another's
    reduction dims): a full pair list by expert, or (`by_expert` False) a decode batch's, one
    program per pair; `pairs_pad` the padded pair list (default: MAX_PAIRS by expert, else 64)."""
    from afdserve.kernels.moe import fp4_decode as k

    common = {
        "PAIRS_PAD": pairs_pad or (k.MAX_PAIRS if by_expert else 64),
        "BY_EXPERT": by_expert,
        "ROWS": tiles.rows,
        "WEIGHTS_LEFT": tiles.weights_left,
        "SPLITS": tiles.splits,
        "ONE_DOT": tiles.one_dot,
    }
    options = tiles.options()
    gate_up = {
        "HAS_LIMIT": True,
        **common,
        "COLUMNS": tiles.gate_up_columns,
        **k.k_constants(hidden, tiles.k_block),
    }
    down = {**common, "COLUMNS": tiles.down_columns, **k.k_constants(inter, tiles.k_block)}
    return (
        compile_for_h200(k._gate_up_kernel, GATE_UP, gate_up, options),
        compile_for_h200(k._down_kernel, DOWN, down, options),
    )


def test_kernels_compile_with_a_k_tail_for_sm90() -> None:
    """gpt-oss's dims (2880 = 22 steps of 128 and a tail of 64): both kernels with their last,
    narrower K step, nothing spilled."""
    from afdserve.kernels.moe import fp4_decode as k

    tiles = k.TILES[0][1]
    assert k.k_steps(2880, tiles.k_block) == (128, 64)
    for by_expert in (True, False):
        for kernel in compile_tiles(tiles, by_expert, 2880, 2880):
            assert kernel.asm["cubin"] and ".local" not in kernel.asm["ptx"]


def test_kernels_compile_for_sm90() -> None:
    """Every tile shape of the table both ways of routing, and the weights as the dot's B
    operand once: nothing spilled to local memory."""
    from afdserve.kernels.moe import fp4_decode as k

    first = k.TILES[0][1]
    builds = [(t, by) for t in dict.fromkeys(t for _, t in k.TILES) for by in (True, False)]
    for tiles, by_expert in [*builds, (first._replace(weights_left=False), True)]:
        for kernel in compile_tiles(tiles, by_expert):
            assert kernel.asm["cubin"] and ".local" not in kernel.asm["ptx"], tiles


def resources(kernel) -> dict[str, int]:
    """The cubin's registers a thread and stack bytes (spills), by the cuobjdump Triton ships."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", usage)}


@pytest.mark.parametrize(
    ("pairs_pad", "by_expert", "splits"),
    [(512, True, 1), (256, False, 1), (64, False, 1), (64, False, 4)],
)
def test_three_programs_an_sm_without_spills(pairs_pad: int, by_expert: bool, splits: int) -> None:
    """At a decode batch's pair lists (64 pairs of a batch of 8, 512 of a batch of 64, and a
    small batch's K split) both kernels of the table's shape keep to `max_registers` with
    nothing spilled: three programs of 4 warps an SM."""
    from afdserve.kernels.moe import fp4_decode as k

    tiles = k.TILES[0][1]._replace(splits=splits)
    assert tiles.weights_left
    for kernel in compile_tiles(tiles, by_expert, pairs_pad=pairs_pad):
        used = resources(kernel)
        assert used["REG"] <= tiles.max_registers and used["STACK"] == 0, (kernel, used)


def test_k_splits_take_whole_steps_and_the_tail_last() -> None:
    """`_splits` cuts a reduction into whole K steps (the last split also takes the tail), never
    into more splits than steps, and runs unsplit past `SPLIT_COUNTERS` programs."""
    from afdserve.kernels.moe import fp4_decode as k

    flash = k.k_constants(4096, 128)  # 32 steps of 128
    assert k._splits(4, 4096, flash, 192) == k.Split(4, 1024)
    assert k._splits(3, 4096, flash, 192) == k.Split(3, 11 * 128)  # 11 + 11 + 10 steps
    assert k._splits(64, 4096, flash, 192) == k.Split(32, 128)
    assert k._splits(4, 4096, flash, k.SPLIT_COUNTERS + 1) == k.Split(1, 4096)
    assert k._splits(1, 4096, flash, 192) == k.Split(1, 4096)
    tail = k.k_constants(2880, 128)  # gpt-oss: 22 steps of 128 and one of 64
    assert k._splits(4, 2880, tail, 192) == k.Split(4, 6 * 128)  # 6 + 6 + 6 + 4 and the tail
    assert k._splits(4, 192, k.k_constants(192, 128), 192) == k.Split(1, 192)  # one step


def sass(kernel) -> str:
    """The cubin's SASS, by the cuobjdump Triton ships."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout


@pytest.mark.parametrize("pairs_pad", [512, 64])
def test_one_dot_waits_once_a_k_step(pairs_pad: int) -> None:
    """`Tiles.one_dot`: both kernels' K loop issues its 16 wgmmas and waits once, where the four
    quarter dots wait four times; the decoded weights stay in registers (no shared-memory copy
    of the A operand), under the register cap and without spills."""
    from afdserve.kernels.moe import fp4_decode as k

    shipped = k.TILES[0][1]
    for one_dot, waits in ((False, 4), (True, 1)):
        tiles = shipped._replace(one_dot=one_dot)
        for kernel in compile_tiles(tiles, pairs_pad == 512, pairs_pad=pairs_pad):
            code = sass(kernel)
            assert code.count("WARPGROUP.DEPBAR") == waits, (tiles, code.count("WARPGROUP.DEPBAR"))
            # What goes to shared memory is x's tile (rows first) alone, never the weights.
            stored = re.findall(r"ttg\.local_alloc %\S+ : \(tensor<(\d+)x", kernel.asm["ttgir"])
            assert stored and all(int(rows) == tiles.rows for rows in stored), stored
            used = resources(kernel)
            assert used["REG"] <= tiles.max_registers and used["STACK"] == 0, (tiles, used)
