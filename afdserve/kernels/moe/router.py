"""The greedy MoE router (scores -> top-k -> normalise -> scale) as two Triton launches.

At decode the torch form is about eight tiny kernels per layer (two casts, the GEMM, softmax,
topk, sum, divide, multiply), each costing a few microseconds even inside a CUDA graph. Here:

1. logits: fp32 partial logits [splits, rows, E] on a grid of (row blocks, expert blocks, splits
   of H). At one row the E*H weight read dominates (0.5 MB for Qwen3-30B-A3B), so H is split
   until the grid has about `TARGET_PROGRAMS` programs and the read is spread over many SMs.
2. select: per row, sum the partials (a fixed order, so results are deterministic), softmax,
   sigmoid or sqrt(softplus) (DeepSeek-V4), top-k by repeated argmax, then normalise and scale.
   With a selection bias (noaux_tc of one group: MiniMax-M2's and DeepSeek-V4's
   `e_score_correction_bias`) the argmax runs over score + bias and each pick's weight is its
   score alone.

Products of bf16/fp16 inputs are exact in fp32 and accumulate in fp32, so the logits equal
`x.float() @ weight.float().T` up to summation order; no tf32 anywhere (inputs are never fp32).
Hash layers (DeepSeek-V4's first three) take the same two launches: a select kernel of their own
reads each row's experts from the layer's `tid2eid` row of its token id, in place of the top-k,
weighs them by their scores, renormalised (the torch form's `+ 1e-20` kept), and asserts the id in
range on the device (so a graph needs no launches of `check_token_ids`). Grouped `noaux_tc` and
`group_limited_greedy` stay on the torch path in `Router.forward`; so do float32 models (their
torch logits are float32 products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 512  # kernel 2 holds a row's scores in registers
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")  # the select kernel's SCORING, by index
TARGET_PROGRAMS = 128  # about one program per SM of an H100/H200 (132); untimed heuristic
MAX_SPLITS = 32  # bounds kernel 2's loop over partials


def supports(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """bf16/fp16 CUDA tensors of one dtype, x [rows, H], contiguous weight [E <= 512, H]."""
    if not (x.is_cuda and weight.is_cuda and x.device == weight.device):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return False
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return False
    # A strided last dim would cost `route` a copy (a third launch); row strides are fine.
    if not weight.is_contiguous() or x.stride(-1) != 1:
        return False
    return 1 <= top_k <= weight.shape[0] <= MAX_EXPERTS


@triton.jit
def _logits_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows,
    experts,
    hidden,
    stride_x,
    chunks_per_split,
    ROWS: tl.constexpr,
    EXPERTS: tl.constexpr,
    K_BLOCK: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    expert = tl.program_id(1) * EXPERTS + tl.arange(0, EXPERTS)
    split = tl.program_id(2)
    row_ok, expert_ok = row < rows, expert < experts
    k = tl.arange(0, K_BLOCK)
    x_rows = x_ptr + row.to(tl.int64)[:, None] * stride_x  # [ROWS, 1]
    w_rows = w_ptr + expert.to(tl.int64)[:, None] * hidden  # [EXPERTS, 1]
    acc = tl.zeros((ROWS, EXPERTS), dtype=tl.float32)
    k_first = split * chunks_per_split * K_BLOCK
    # The last split may run past H: its extra steps are fully masked and read nothing.
    for step in range(0, chunks_per_split):
        k0 = k_first + step * K_BLOCK
        k_ok = k0 + k < hidden
        xs = tl.load(x_rows + k0 + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        ws = tl.load(w_rows + k0 + k[None, :], mask=expert_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xs, tl.trans(ws), acc)  # bf16/fp16 in, fp32 accumulate
    out = out_ptr + (split * rows + row)[:, None] * experts + expert[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & expert_ok[None, :])


@triton.jit
def _softplus(x):
    """torch's softplus (beta 1, threshold 20: x itself above it), with log1p(e^x) taken by
    Goldberg's form log(u) * y / (u - 1), u = 1 + y: accurate where e^x is far below 1, which a
    plain log(1 + y) rounds away."""
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _row_scores(partial_ptr, row, rows, experts, splits, SCORING: tl.constexpr,
                E_PAD: tl.constexpr):  # fmt: skip
    """The row's scores [E_PAD] float32 from its split logits, -inf past the experts."""
    e = tl.arange(0, E_PAD)
    ok = e < experts
    logits = tl.zeros((E_PAD,), dtype=tl.float32)
    for s in range(0, splits):
        logits += tl.load(partial_ptr + (s * rows + row) * experts + e, mask=ok, other=0.0)
    if SCORING == 1:
        scores = tl.sigmoid(logits)
    elif SCORING == 2:
        scores = tl.sqrt_rn(_softplus(logits))
    else:
        # Padded experts are -inf before the softmax, so they add nothing to the denominator.
        logits = tl.where(ok, logits, float("-inf"))
        p = tl.exp(logits - tl.max(logits, axis=0))
        scores = p / tl.sum(p, axis=0)
    # Below every real score (every scoring is >= 0), so padding is never picked.
    return tl.where(ok, scores, float("-inf"))


@triton.jit
def _select_kernel(
    partial_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    rows,
    experts,
    splits,
    scale,
    HAS_BIAS: tl.constexpr,
    SCORING: tl.constexpr,  # an index into SCORINGS
    NORMALIZE: tl.constexpr,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    ok = e < experts
    scores = _row_scores(partial_ptr, row, rows, experts, splits, SCORING, E_PAD)
    if HAS_BIAS:  # what picks the experts; their weights stay the scores
        choice = scores + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    else:
        choice = scores
    slot = tl.arange(0, K_PAD)
    top_ids = tl.zeros((K_PAD,), dtype=tl.int64)
    top_weights = tl.zeros((K_PAD,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        # The lowest index among ties; clamped so a NaN row can never yield an out-of-range id.
        pick = tl.minimum(tl.min(tl.where(choice == best, e, E_PAD), axis=0), experts - 1)
        if HAS_BIAS:
            best = tl.sum(tl.where(e == pick, scores, 0.0), axis=0)  # exactly scores[pick]
        top_ids = tl.where(slot == j, pick.to(tl.int64), top_ids)
        top_weights = tl.where(slot == j, best, top_weights)
        choice = tl.where(e == pick, float("-inf"), choice)
    if NORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=0)  # K_PAD padding is 0
    keep = slot < TOP_K
    tl.store(ids_ptr + row * TOP_K + slot, top_ids, mask=keep)
    tl.store(weights_ptr + row * TOP_K + slot, top_weights * scale, mask=keep)


# Compiled with device asserts on (debug): under a CUDA graph the token ids are checked here,
# where `check_token_ids` would add its own launches; eagerly the caller checks them first.
@triton.jit(debug=True)
def _hash_select_kernel(
    partial_ptr,
    table_ptr,
    tokens_ptr,
    ids_ptr,
    weights_ptr,
    rows,
    experts,
    splits,
    table_rows,
    scale,
    SCORING: tl.constexpr,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
):
    """A hash layer's routing: the row's experts are tid2eid[token id] in the table's order,
    weighed by their scores renormalised (`Router.forward`'s `+ 1e-20` kept)."""
    row = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    scores = _row_scores(partial_ptr, row, rows, experts, splits, SCORING, E_PAD)
    slot = tl.arange(0, K_PAD)
    keep = slot < TOP_K
    token = tl.load(tokens_ptr + row).to(tl.int64)
    tl.device_assert((token >= -1) & (token < table_rows), "token id outside the hash table")
    # Pad rows carry token id -1 and look up row 0 (their output is dropped).
    token = tl.minimum(tl.maximum(token, 0), table_rows - 1)
    top_ids = tl.load(table_ptr + token * TOP_K + slot, mask=keep, other=0)
    # Each pick's score out of the row's registers (the loader checked the ids < experts).
    hit = (e[None, :] == top_ids[:, None]) & keep[:, None]
    top_weights = tl.sum(tl.where(hit, scores[None, :], 0.0), axis=1)
    top_weights = top_weights / (tl.sum(top_weights, axis=0) + 1e-20)
    tl.store(ids_ptr + row * TOP_K + slot, top_ids, mask=keep)
    tl.store(weights_ptr + row * TOP_K + slot, top_weights * scale, mask=keep)


def _tiles(rows: int) -> tuple[int, int, int, int]:
    """(rows, experts, K step, warps) of a logits program. Decode keeps the expert block at
    tl.dot's smallest width (16) for parallelism; larger batches widen it so x is re-read less."""
    row_block = min(64, max(16, triton.next_power_of_2(rows)))
    if rows <= 64:
        return row_block, 16, 128, 4
    return row_block, 64, 64, 4


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    scoring: str,
    normalize: bool,
    scale: float,
    bias: torch.Tensor | None = None,
    hashed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, H] bf16/fp16, weight [E, H] of the same dtype -> (ids int64 [rows, top_k],
    weights float32 [rows, top_k], descending; with `bias` [E] (added to the scores for the
    choice only) in the order of score + bias). With `hashed` = (tid2eid int64 [V, top_k],
    token ids [rows], -1 for pad rows) a hash layer's: the table row's experts in its order,
    weighed by their scores renormalised (`normalize` and `bias` unread); an id outside [-1, V)
    stops the kernel with a device-side assert (check them first for a clear error). Check
    `supports` first; this only assumes the shapes, so it also runs on CPU tensors under
    TRITON_INTERPRET=1."""
    rows, hidden = x.shape
    experts = weight.shape[0]
    if hashed is not None:
        table, tokens = hashed[0].contiguous(), hashed[1]
        if tokens.dim() == 1 and tokens.stride(0) != 1:
            tokens = tokens.contiguous()
        if table.dim() != 2 or table.shape[1] != top_k or tuple(tokens.shape) != (rows,):
            raise ValueError(
                f"hash routing: a [V, {top_k}] table and {rows} token ids, got "
                f"{tuple(table.shape)} and {tuple(tokens.shape)}"
            )
    ids = torch.empty(rows, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=x.device)
    if rows == 0:
        return ids, weights
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()  # a no-op for the weights `supports` accepts
    row_block, expert_block, k_block, warps = _tiles(rows)
    grid_rows, grid_experts = triton.cdiv(rows, row_block), triton.cdiv(experts, expert_block)
    chunks = triton.cdiv(hidden, k_block)
    splits = max(1, min(chunks, MAX_SPLITS, TARGET_PROGRAMS // (grid_rows * grid_experts)))
    chunks_per_split = triton.cdiv(chunks, splits)
    splits = triton.cdiv(chunks, chunks_per_split)  # drop splits that would have no chunk
    partial = torch.empty(splits, rows, experts, dtype=torch.float32, device=x.device)
    _logits_kernel[(grid_rows, grid_experts, splits)](
        x,
        weight,
        partial,
        rows,
        experts,
        hidden,
        x.stride(0),
        chunks_per_split,
        ROWS=row_block,
        EXPERTS=expert_block,
        K_BLOCK=k_block,
        num_warps=warps,
    )
    e_pad = triton.next_power_of_2(experts)
    common = dict(SCORING=SCORINGS.index(scoring), TOP_K=top_k, E_PAD=e_pad)
    common |= dict(K_PAD=triton.next_power_of_2(top_k), num_warps=1 if e_pad <= 256 else 4)
    if hashed is not None:
        _hash_select_kernel[(rows,)](
            partial, table, tokens, ids, weights, rows, experts, splits, table.shape[0],
            float(scale), **common,
        )  # fmt: skip
        return ids, weights
    _select_kernel[(rows,)](
        partial,
        partial if bias is None else bias,  # unread without a bias
        ids,
        weights,
        rows,
        experts,
        splits,
        float(scale),
        HAS_BIAS=bias is not None,
        NORMALIZE=bool(normalize),
        **common,
    )
    return ids, weights
