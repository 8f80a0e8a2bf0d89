"""The paged attention kernel (kernels/triton/attention.py) compiles for the H200 (sm_90) on any
machine with Triton, no GPU needed, at the launches `paged_attention` picks, and the properties
its launch constants rely on hold in what Triton emits: no spills in the main loop, the FP8
decode launch within 128 registers (4 programs per SM), and its pipeline keeping the next tile's
K/V copies in flight while the current tile computes (the loop waits with `async_wait num` > 0),
where 3 stages, as for the bf16 cache, wait for every copy at the loop top (num = 0). Numbers
are tests/gpu/test_kernels.py's and tests/gpu/test_kv_fp8.py's (and, on CPU,
tests/kernels/test_attention_interpret.py's)."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

H200 = ("cuda", 90, 32)
POINTERS = {
    "Q": "*bf16",
    "Out": "*bf16",
    "OPart": "*fp32",
    "LSE": "*fp32",
    "Sinks": "*bf16",
    "block_tables": "*i32",
    "query_start": "*i32",
    "context_lens": "*i32",
}
FLOATS = {"qk_scale_log2": "fp32", "v_scale": "fp32"}


def compile_for_h200(
    fp8: bool,
    launch,
    block_q: int = 2,
    direct: bool = False,
    gpt_oss: bool = False,
    head_dim: int = 128,
    group: int = 8,
    flat: bool = False,
) -> object:
    """The kernel at Qwen3-30B-A3B's heads (32 q heads, 4 KV heads, dim 128, cache block 16):
    a decode launch (`block_q` 2: 16 rows of 8 heads) or a prefill one (8: 64 rows). `gpt_oss`:
    with sinks and a window, at dim 64 (its 64 q heads over 8 KV heads: the same group)."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from afdserve.kernels.triton import attention as ta

    kernel = ta._paged_attention_kernel
    kv = "*fp8e4nv" if fp8 else "*bf16"
    constants = {
        "GROUP": group,
        "GROUP_PAD": group,
        "BLOCK_Q": block_q,
        "HEAD_DIM": 64 if gpt_oss else head_dim,
        "DIM_PAD": 64 if gpt_oss else triton.next_power_of_2(head_dim),
        "CACHE_BLOCK": 16,
        "BLOCK_N": launch.block_n,
        "DIRECT": direct,
        "IEEE": False,
        "FP8_KV": fp8,
        "DOT_DTYPE": tl.float16,
        "CAUSAL": not (fp8 and block_q == 2),
        "HAS_SINKS": gpt_oss,  # gpt-oss's sinks and windows: compiled away elsewhere
        "HAS_WINDOW": gpt_oss,
        "FLAT": flat,
    }
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update(POINTERS, **FLOATS, K=kv, V=kv)
    signature.update({name: "constexpr" for name in constants})
    # What a launch specializes as multiples of 16: torch's allocations and the strides.
    aligned = [n for n in kernel.arg_names if signature[n].startswith("*") or "stride" in n]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    options = {"num_warps": launch.warps, "num_stages": launch.stages}
    if launch.maxnreg is not None:
        options["maxnreg"] = launch.maxnreg
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*H200), options=options)


def loop_waits(compiled) -> list[int]:
    """`num` of each async_wait in the main loop's body (scf.for up to its scf.yield)."""
    loop = compiled.asm["ttgir"].split("scf.for", 1)[1].split("scf.yield", 1)[0]
    return [int(n) for n in re.findall(r"ttg\.async_wait[^\n]*num = (\d+)", loop)]


def main_loop(sass: str) -> list[str]:
    """The SASS of the loop with the most MMAs: from a label to the branch back to it."""
    lines = sass.splitlines()
    labels = {}
    for i, text in enumerate(lines):
        if m := re.match(r"(\w+):$", text.strip()):
            labels[m.group(1)] = i
    best: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA (\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)] : i + 1]
            if sum("MMA" in b for b in body) > sum("MMA" in b for b in best):
                best = body
    return best


def assert_loop_does_not_spill(compiled) -> None:
    """No spill traffic in the main loop. (The FP8 decode launch's 128-register cap spills 3
    values that live across the loop: stored once before it, loaded once after.)"""
    assert compiled.asm["cubin"] and ".local" not in compiled.asm["ptx"]
    try:
        sass = compiled.asm["sass"]
    except Exception:  # no nvdisasm beside this Triton: the PTX check stands alone
        return
    loop = main_loop(sass)
    assert sum("MMA" in line for line in loop) >= 2, "found no main loop"
    assert not any(re.search(r"\b(LDL|STL)\b", line) for line in loop), "spills in the loop"


def test_fp8_decode_launch_overlaps_loads_within_128_registers() -> None:
    from afdserve.kernels.triton import attention as ta

    for direct in (False, True):
        compiled = compile_for_h200(True, ta.FP8_DECODE_LAUNCH, direct=direct)
        assert_loop_does_not_spill(compiled)
        assert ".maxnreg 128" in compiled.asm["ptx"]
        waits = loop_waits(compiled)
        assert waits and min(waits) > 0, waits


def test_three_stages_wait_for_every_copy() -> None:
    """The diagnosis the FP8 decode launch answers, on the bf16 cache's launch as on FP8's."""
    from afdserve.kernels.triton import attention as ta

    for fp8 in (False, True):
        compiled = compile_for_h200(fp8, ta.DEFAULT_LAUNCH)
        assert_loop_does_not_spill(compiled)
        assert loop_waits(compiled) == [0]


def test_prefill_launches_compile() -> None:
    from afdserve.kernels.triton import attention as ta

    for fp8 in (False, True):
        assert_loop_does_not_spill(compile_for_h200(fp8, ta.DEFAULT_LAUNCH, block_q=8))
    # What paged_attention launches for prefill over a bf16 cache at Qwen3-30B-A3B's heads: 128
    # rows. (Over an FP8 cache they spill in the loop: it keeps DEFAULT_LAUNCH's 64, above.)
    block_q = ta.query_block(False, 8, 128, ta.PREFILL_LAUNCH.prefill_rows)
    assert block_q == 16
    for flat in (False, True):  # a program per segment's block, or per block of the step
        compiled = compile_for_h200(False, ta.PREFILL_LAUNCH, block_q=block_q, flat=flat)
        assert_loop_does_not_spill(compiled)


def test_gpt_oss_launches_compile_without_spills() -> None:
    """Sinks (in the direct store, or left to the combine kernel) and windows, decode and
    prefill, on both caches."""
    from afdserve.kernels.triton import attention as ta

    for fp8 in (False, True):
        for block_q, direct in ((2, False), (2, True), (8, True)):
            launch = ta.FP8_DECODE_LAUNCH if fp8 and block_q == 2 else ta.DEFAULT_LAUNCH
            compiled = compile_for_h200(fp8, launch, block_q, direct, gpt_oss=True)
            assert_loop_does_not_spill(compiled)
    for direct in (False, True):  # prefill over a bf16 cache: PREFILL_LAUNCH's 128 rows
        compiled = compile_for_h200(False, ta.PREFILL_LAUNCH, 16, direct, gpt_oss=True)
        assert_loop_does_not_spill(compiled)


def test_wide_heads_fit_the_shared_memory_of_sm_90() -> None:
    """Kimi-Linear's NoPE MLA reads its 576-channel latent whole (padded to 1024), 32 query
    heads over it: the launch and query block `paged_attention` picks for such heads, decode
    and prefill, fit sm_90's 227 KiB of shared memory (232448 bytes a block), where the default
    launch asks 332 KB at decode and failed to launch on an H100 (OutOfResources)."""
    from afdserve.kernels.triton import attention as ta

    limit = 232448
    for dim in (512, 576):
        for decode in (True, False):
            block_q = ta.query_block(decode, 32, dim)
            wide = compile_for_h200(False, ta.WIDE_LAUNCH, block_q, head_dim=dim, group=32)
            assert wide.metadata.shared <= limit, (dim, decode, wide.metadata.shared)
    assert ta.query_block(False, 8, 128) == 8  # narrow heads keep their tiles
    default = compile_for_h200(False, ta.DEFAULT_LAUNCH, 1, head_dim=576, group=32)
    assert default.metadata.shared > limit
