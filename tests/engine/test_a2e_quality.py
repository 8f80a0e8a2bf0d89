"""What the fp8 A2E payload costs in quality on the bundled tiny model (float32, colocated: AFD
gives the same tokens under the same setting, tests/afd/test_a2e.py): greedy runs with fp8 rows
against the model-dtype rows. Per step, the greedy token agrees while the two runs share their
context (a divergence counts as one disagreement); over that shared context, the mean |delta| of
the chosen token's logprob. The random tiny model has flat logits, so these are a worst case.
Measured: agreement 0.935, mean |delta logprob| 0.064 (a bfloat16 wire: 0.990 and 0.006)."""

from __future__ import annotations

import random

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.bundled import bundled_model_dir

PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)


def _run(prompts, **kwargs) -> list[tuple[list[int], list[float]]]:
    with LLM(
        str(bundled_model_dir()), dtype="float32", max_num_batched_tokens=256, **kwargs
    ) as llm:
        outs = llm.generate(prompts, PARAMS)
    return [(o.token_ids, [lp[t] for t, lp in zip(o.token_ids, o.logprobs)]) for o in outs]


def agreement(base, other) -> tuple[float, float]:
    """(per-step greedy agreement, mean |delta logprob| over the shared context)."""
    agree = diverged = 0
    deltas: list[float] = []
    for (tokens_a, lp_a), (tokens_b, lp_b) in zip(base, other, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(tokens_a, tokens_b)) if a != b), len(tokens_a))
        agree, diverged = agree + n, diverged + (n < len(tokens_a))
        deltas += [abs(a - b) for a, b in zip(lp_a[:n], lp_b[:n])]
    return agree / (agree + diverged), sum(deltas) / len(deltas)


def test_fp8_wire_quality_on_the_bundled_model():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))] for _ in range(32)]
    base = _run(prompts)
    fp8 = agreement(base, _run(prompts, a2e_dtype="fp8"))
    bf16 = agreement(base, _run(prompts, a2e_dtype="bfloat16"))
    print(
        f"fp8 wire: agreement {fp8[0]:.3f}, mean |dlogprob| {fp8[1]:.4f}; "
        f"bf16 wire: {bf16[0]:.3f}, {bf16[1]:.4f}"
    )
    assert fp8[0] > 0.9 and fp8[1] < 0.1
    assert bf16[0] > fp8[0] and bf16[1] < fp8[1]  # fewer bits, more drift: the option is live
