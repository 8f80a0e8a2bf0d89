"""The FP8 expert kernels (kernels/moe/fp8_decode.py's decode kernels and the FP8 path of
kernels/moe/grouped.py) compile for the H200 (sm_90) down to a cubin on any machine with
Triton, no GPU needed: both operand orders, w8a8 and weight-only, nothing spilled to local
memory. With the weights as the dots' left operand (the decode kernels' default; the grouped
ones' option, off for now) their inner loops take fewer
SASS instructions per weight than with the weights right, at Qwen3-30B-A3B's shapes: a decode
batch of 1 at top-8 (8 pairs) and the grouped kernels' batch of 64 (512 pairs). Their numbers
are tests/gpu/test_fp8_kernels.py's (on CPU, tests/kernels/test_fp8_moe_interpret.py's).

    PYTHONPATH=/path/to/triton:$PWD python tests/kernels/test_fp8_moe_compile.py

prints the instructions per weight of every build (the table in triton_fp8_moe's docstring)."""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

H200 = ("cuda", 90, 32)
HIDDEN, INTER, EXPERTS = 2048, 768, 128  # Qwen3-30B-A3B's experts
X, FP8, SCALE = "*bf16", "*fp8e4nv", "*fp32"
DECODE_GATE_UP = {
    "x_ptr": X,
    "ids_ptr": "*i64",
    "w_ptr": FP8,
    "s_ptr": SCALE,
    "h_ptr": X,
    "num_pairs": "i32",
    "top_k": "i32",
    "hidden": "i32",
    "inter": "i32",
    "s_expert": "i32",
    "s_row": "i32",
    "inter_blocks": "i32",
}
DECODE_DOWN = {
    "h_ptr": X,
    "ids_ptr": "*i64",
    "weights_ptr": "*fp32",
    "w_ptr": FP8,
    "s_ptr": SCALE,
    "y_ptr": "*fp32",
    "num_pairs": "i32",
    "hidden": "i32",
    "inter": "i32",
    "s_expert": "i32",
    "s_row": "i32",
}
GROUPED_GATE_UP = {
    "x_ptr": X,
    "slots_ptr": "*i32",
    "end_ptr": "*i32",
    "count_ptr": "*i32",
    "w_ptr": FP8,
    "s_ptr": SCALE,
    "h_ptr": X,
    "num_experts": "i32",
    "top_k": "i32",
    "hidden": "i32",
    "inter": "i32",
    "s_expert": "i32",
    "s_row": "i32",
    "inter_blocks": "i32",
    "limit": "fp32",
    "bias_ptr": X,
    "alpha": "fp32",
}
GROUPED_DOWN = {
    "h_ptr": X,
    "slots_ptr": "*i32",
    "end_ptr": "*i32",
    "count_ptr": "*i32",
    "weights_ptr": "*fp32",
    "w_ptr": FP8,
    "s_ptr": SCALE,
    "y_ptr": "*fp32",
    "num_experts": "i32",
    "hidden": "i32",
    "inter": "i32",
    "s_expert": "i32",
    "s_row": "i32",
    "bias_ptr": X,
}
# What a launch at these shapes specializes as multiples of 16: the pointers, the dims, the
# experts' scale strides (gate/up's grid [E, 12, 16]: 192 and 16; down's [E, 16, 6]: 96, not 6).
ALIGNED = {
    "x_ptr",
    "ids_ptr",
    "w_ptr",
    "s_ptr",
    "h_ptr",
    "weights_ptr",
    "y_ptr",
    "slots_ptr",
    "end_ptr",
    "count_ptr",
    "num_experts",
    "hidden",
    "inter",
    "s_expert",
}


def compile_for_h200(kernel, signature: dict, constants: dict, options: dict) -> object:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = ALIGNED | ({"s_row"} if "inter_blocks" in signature else set())
    names = aligned & {*signature}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}
    signature = {**signature, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*H200), options=options)


def inner_loop(sass: str) -> list[str]:
    """The instructions of the innermost loop that issues MMAs (the K loop): from a label to the
    last branch back to it."""
    labels, body, loops = {}, [], []
    for line in sass.splitlines():
        if re.fullmatch(r"[\w.$]+:", line.strip()):
            labels[line.strip()[:-1]] = len(body)
        elif "\t" in line:  # control codes, a tab, the instruction
            body.append(line.split("\t", 1)[1].strip())
    for end, text in enumerate(body):
        jump = re.search(r"\bBRA\s+([\w.$]+)", text)
        if jump and labels.get(jump.group(1), end + 1) <= end:
            loops.append(body[labels[jump.group(1)] : end + 1])
    loops = [loop for loop in loops if any("MMA" in t for t in loop)]
    assert loops, "no loop issues an MMA"
    return min(loops, key=len)


def per_weight(kernel, warps: int, weights_per_step: int) -> float:
    """Thread instructions per weight of the K loop: its SASS instructions (each one a warp's),
    times the warp's 32 threads and the program's warps, over the weights one step reads."""
    return len(inner_loop(kernel.asm["sass"])) * 32 * warps / weights_per_step


def builds() -> list[tuple[str, bool, bool, object, float]]:
    """(kernel, a8, weights left, compiled, instructions per weight) of every build."""
    from afdserve.kernels.moe import fp8_decode as triton_fp8_moe
    from afdserve.kernels.moe import grouped as triton_grouped_moe
    from afdserve.kernels.moe.decode import _k_block
    from afdserve.kernels.moe.routing import rows_per_tile
    from afdserve.kernels.triton import fp8_weight_only as triton_fp8

    out = []
    step = _k_block(HIDDEN), _k_block(INTER)
    pairs = 8
    for a8 in (True, False):
        for left in (True, False):
            tiles = triton_fp8_moe.tiles_for(pairs, left)
            rows = tiles.rows or rows_per_tile(pairs, EXPERTS)
            common = {"PAIRS_PAD": 64, "BY_EXPERT": False, "ROWS": rows, "WEIGHTS_LEFT": left}
            options = {"num_warps": tiles.warps, "num_stages": tiles.stages}
            for name, kernel, sig, columns, weight_rows, k in (
                (
                    "decode gate/up",
                    triton_fp8_moe._gate_up_kernel,
                    DECODE_GATE_UP,
                    tiles.gate_up_columns,
                    2 * tiles.gate_up_columns,
                    step[0],
                ),
                (
                    "decode down",
                    triton_fp8_moe._down_kernel,
                    DECODE_DOWN,
                    tiles.down_columns,
                    tiles.down_columns,
                    step[1],
                ),
            ):
                modes = triton_fp8.operand_modes(a8, k, torch.bfloat16)
                constants = {**common, "COLUMNS": columns, "K_BLOCK": k, **modes}
                built = compile_for_h200(kernel, sig, constants, options)
                out.append((name, a8, left, built, per_weight(built, tiles.warps, weight_rows * k)))
    grouped_pairs = 64 * 8
    gate_up_columns, down_columns, warps, stages = triton_grouped_moe.FP8_COLUMNS
    rows = triton_grouped_moe.rows_per_tile(grouped_pairs, EXPERTS, True)
    for a8 in (True, False):
        for left in (True, False):
            common = {
                "ROWS": rows,
                "E_PAD": EXPERTS,
                "W_FP8": True,
                "WEIGHTS_LEFT": left,
                "GDC": triton_grouped_moe.GDC,
            }
            options = {"num_warps": warps, "num_stages": stages}
            # As moe_experts launches them: tiles of one scale block with the weights right.
            down = down_columns if left else min(down_columns, 128)
            for name, kernel, sig, columns, weight_rows, k in (
                (
                    "grouped gate/up",
                    triton_grouped_moe._gate_up_kernel,
                    GROUPED_GATE_UP,
                    gate_up_columns,
                    2 * gate_up_columns,
                    step[0],
                ),
                (
                    "grouped down",
                    triton_grouped_moe._down_kernel,
                    GROUPED_DOWN,
                    down,
                    down,
                    step[1],
                ),
            ):
                modes = triton_fp8.operand_modes(a8, k, torch.bfloat16)
                constants = {**common, "COLUMNS": columns, "K_BLOCK": k, **modes}
                built = compile_for_h200(kernel, sig, constants, options)
                out.append((name, a8, left, built, per_weight(built, warps, weight_rows * k)))
    return out


def test_fp8_expert_kernels_compile_for_sm90_and_weights_left_take_fewer_instructions() -> None:
    results = builds()
    for name, a8, left, built, _ in results:
        assert built.asm["cubin"] and ".local" not in built.asm["ptx"], (name, a8, left)
    cost = {(name, a8, left): n for name, a8, left, _, n in results}
    for (name, a8, left), n in cost.items():
        if left:
            assert n < cost[name, a8, False], (name, a8, n, cost[name, a8, False])


if __name__ == "__main__":
    for name, a8, left, _, n in builds():
        mode = "w8a8" if a8 else "weight-only"
        side = "weights left" if left else "weights right"
        print(f"{name:<16} {mode:<12} {side:<14} {n:5.2f} instructions per weight")
