"""DeepSeek-V4's compressor kernels (kernels/triton/v4_compress.py: the pooling, decode and chunk
forms, and the chunk form's state writes) and its attention kernel compile for the H200 (sm_90)
down to a cubin, on any machine with Triton, at V4-Flash's shapes (head_dim 512 with 64 rotated
channels; CSA at rate 4 with its indexer at 128, HCA at 128), bf16 pages and FP8 ones. Their
numbers are tests/kernels/test_v4_compress*_interpret.py's and test_v4_attention_interpret.py's
on CPU."""

from __future__ import annotations

import pytest

from tests.kernels.test_fp8_moe_compile import compile_for_h200

triton = pytest.importorskip("triton")

# (rate, dim, overlap): CSA's compressor, its indexer's, HCA's.
COMPRESSORS = [(4, 512, True), (4, 128, True), (128, 512, False)]


def compress_signature(fp8: bool) -> dict:
    page = "*u8" if fp8 else "*bf16"
    pointers = dict.fromkeys(("KV", "GATE", "OPEN_KV", "OPEN_GATE", "PREV_KV", "NEW"), "*bf16")
    pointers |= dict.fromkeys(("PREV_GATE", "BIAS", "NORM_WEIGHT", "INV_FREQ"), "*fp32")
    pointers |= dict.fromkeys(("ADDRESSES", "ENTRY_ROW", "POSITIONS", "START"), "*i64")
    scalars = {"rows": "i32", "row": "i32", "norm_eps": "fp32", "scaling": "fp32", "nope": "i32"}
    return {
        **pointers,
        "ENTRIES": page,
        "ENTRY_ROPE": "*bf16",
        "REAL": "*i1",
        **scalars,
        "kv_scale": "fp32",
    }


@pytest.mark.parametrize(("rate", "dim", "overlap"), COMPRESSORS)
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_compress_kernels_compile_for_sm90(rate, dim, overlap, chunked, fp8) -> None:
    from afdserve.kernels.triton import v4_compress as k

    width = 2 * dim if overlap else dim
    address_width = rate + 1 + (2 * rate if overlap else 0) + (rate if overlap and chunked else 0)
    shape = {
        "M": rate,
        "M_PAD": triton.next_power_of_2(rate),
        "DIM": dim,
        "WIDTH": width,
        "ADDRESS_WIDTH": address_width,
        "BLOCK": min(k.BLOCK_COLUMNS, triton.next_power_of_2(dim)),
    }
    constants = {**shape, "SECOND": dim if overlap else 0, "ROPE": 64, "OVERLAP": overlap}
    constants |= {"FP8": fp8, "CHUNKED": chunked}
    options = {"num_warps": 8 if rate >= 32 else 4}
    signature = {
        n: t for n, t in compress_signature(fp8).items() if n in k._compress_kernel.arg_names
    }
    built = compile_for_h200(k._compress_kernel, signature, constants, options)
    assert built.asm["cubin"]
    if chunked:
        names = k._chunk_writes_kernel.arg_names
        writes = {n: t for n, t in compress_signature(fp8).items() if n in names}
        writes["KEEP"] = "*i1"
        for first in (True, False) if overlap else (False,):
            built = compile_for_h200(
                k._chunk_writes_kernel, writes, {**shape, "FIRST": first}, options
            )
            assert built.asm["cubin"] and ".local" not in built.asm["ptx"]


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("fp8", [False, True])
def test_attention_kernel_compiles_for_sm90(kind, fp8) -> None:
    from afdserve.kernels.triton import v4_attention as k

    page = "*u8" if fp8 else "*bf16"
    signature = dict.fromkeys(("Q", "OWN", "NEW", "OUT"), "*bf16")
    signature |= {"WINDOW_PAGE": page, "ENTRY_PAGE": page, "WINDOW_ROPE": "*bf16"}
    signature |= {"ENTRY_ROPE": "*bf16", "SINKS": "*fp32", "REAL": "*i1"}
    signature |= dict.fromkeys(("WINDOW_ROWS", "READ", "TABLES", "POSITIONS", "START"), "*i64")
    signature |= dict.fromkeys(("rows", "heads", "dim", "width", "nope"), "i32")
    signature |= {"scale": "fp32", "kv_scale": "fp32"}
    rate = {"sliding": 1, "csa": 4, "hca": 128}[kind]
    constants = {
        "WINDOW": 128,
        "ENTRIES": 512 if kind == "csa" else 0,
        "RATE": rate,
        "EVERY": kind == "hca",
        "BLOCK_SIZE": 256,
        "SLOTS": 256 // rate,
        "BLOCK_H": k.BLOCK_HEADS,
        "BLOCK_N": k.BLOCK_KEYS,
        "BLOCK_D": 512,
        "PRECISION": "tf32",
        "FP8": fp8,
        "STORE": True,
    }
    built = compile_for_h200(k._sparse_attention_kernel, signature, constants, {"num_warps": 8})
    assert built.asm["cubin"]
