"""What the DeepSeek-V4 tests share: where the lightning indexer meets an exact tie.

The indexer keeps each query's `index_topk` best-scoring compressed entries. Scores can tie
exactly (relu zeroes every index head: 0.0), and then which entry is kept is not defined by the
model: transformers takes `torch.topk`'s choice, which depends on the tensor's shape (its full
forward and its cached decode pick differently), afdserve the earliest entry. A comparison with
transformers therefore means something only on inputs without a tie at the top-k boundary.
"""

from __future__ import annotations

import torch

from afdserve.model.families.deepseek_v4.model import V4CausalLM


@torch.inference_mode()
def boundary_ties(model: V4CausalLM, ids: torch.Tensor) -> list[tuple[int, int]]:
    """(layer, row) of every query whose k-th and (k+1)-th best closed entries score the same,
    in the full forward of `ids`."""
    seen: dict[int, tuple] = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda module, args, i=i: seen.__setitem__(i, args)
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        model.forward_full(ids)
    finally:
        for hook in hooks:
            hook.remove()
    ties = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if attn.kind != "compressed_sparse_attention":
            continue
        x, positions, _, compress_rope = seen[i][:4]
        indexer = attn.compressor.indexer
        scores, _ = indexer.scores(
            x, attn.q_a_norm(attn.q_a_proj(x)), positions, compress_rope, None
        )
        k = indexer.topk
        if scores.shape[1] <= k:
            continue
        ranked = scores.sort(dim=-1, descending=True).values
        tied = (ranked[:, k - 1] == ranked[:, k]) & torch.isfinite(ranked[:, k])
        ties += [(i, int(row)) for row in tied.nonzero().flatten()]
    return ties
