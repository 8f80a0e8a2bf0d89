"""How far an FP8 KV cache (kv_cache_dtype="fp8", scale 1.0) moves a tiny model's outputs, on CPU.

For each model (the bundled tiny Qwen3-MoE, a tiny DeepSeek-V2, whose MLA caches the latent, and
a tiny DeepSeek-V4, whose pages hold window rows and compressed entries) and dtype: the greedy
continuation of each prompt with the model-dtype cache (the reference); then, teacher-forced on
that continuation, the same engine with the FP8 cache. Printed:
  agree   the share of positions where the FP8 cache's argmax is the reference's token
  |dlp|   mean |logprob_fp8(t) - logprob_ref(t)| of the reference's token t (nats)
  max     the largest of those
  free    the share of positions where the FP8 cache's own free-running greedy tokens equal
          the reference's (after a first divergence the two continue from different prefixes)

    PYTHONPATH=. python tools/kv_fp8_quality.py [--tokens 16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.bundled import BUNDLED_FAMILY
from afdserve.model.fixtures.tiny import make_tiny_model

PROMPTS = [
    [7],
    [72, 101, 108, 108, 111],
    list(range(30, 58)),
    [256, 40, 41, 42, 200, 3, 4],
    [(17 * i) % 256 for i in range(45)],
    [97, 98, 99, 100, 101, 102],
    [255, 0, 255, 0],
    [(5 * i + 1) % 250 for i in range(20)],
]
TOP = 20  # the most logprobs a request returns; the reference's token is nearly always among them

Continuation = tuple[list[int], list[float]]


def tiny_models(root: Path) -> dict[str, Path]:
    """The bundled model (built as bundled.py builds it), a tiny MLA and a tiny V4 checkpoint."""
    return {
        "bundled": make_tiny_model(root / "bundled", BUNDLED_FAMILY, hash_layers=1, seed=0),
        "deepseek_v2": make_tiny_model(root / "deepseek_v2", "deepseek_v2", seed=0),
        "deepseek_v4": make_tiny_model(root / "deepseek_v4", "deepseek_v4", seed=0),
    }


def continuations(llm: LLM, prompts: list[list[int]], tokens: int) -> list[Continuation]:
    """Greedy continuation of every prompt and the logprob of each of its tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        )
        for o in outs
    ]


def teacher_forced(
    llm: LLM, prompts: list[list[int]], ref: list[Continuation]
) -> tuple[float, float, float]:
    """(agreement, mean |d logprob|, max |d logprob|) of `llm` along the reference
    continuations; a reference token outside the top TOP logprobs counts as a disagreement and
    is left out of the logprob figures."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP)
    agree, deltas, count = 0, [], 0
    for j in range(len(ref[0][0])):
        forced = [p + toks[:j] for p, (toks, _) in zip(prompts, ref)]
        for out, (toks, lps) in zip(llm.generate(forced, params, use_tqdm=False), ref):
            got = out.outputs[0]
            count += 1
            agree += got.token_ids[0] == toks[j]
            if toks[j] in got.logprobs[0]:
                deltas.append(abs(got.logprobs[0][toks[j]] - lps[j]))
    return agree / count, sum(deltas) / max(len(deltas), 1), max(deltas, default=0.0)


def measure(model: Path, dtype: str, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    """The FP8 cache's figures against the model-dtype cache (see the module docstring)."""
    with LLM(str(model), dtype=dtype) as llm:
        ref = continuations(llm, prompts, tokens)
    with LLM(str(model), dtype=dtype, kv_cache_dtype="fp8") as llm:
        agree, mean, top = teacher_forced(llm, prompts, ref)
        free = continuations(llm, prompts, tokens)
    same = sum(a == b for (x, _), (y, _) in zip(ref, free) for a, b in zip(x, y))
    return {"agree": agree, "dlp": mean, "max": top, "free": same / (tokens * len(prompts))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"{len(PROMPTS)} prompts x {args.tokens} tokens, teacher-forced, FP8 cache against "
        "the model-dtype cache"
    )
    print(f"{'model':<12} {'dtype':<9} {'agree':>7} {'|dlp|':>8} {'max':>8} {'free':>7}")
    with tempfile.TemporaryDirectory() as root:
        for name, path in tiny_models(Path(root)).items():
            for dtype in ("float32", "bfloat16"):
                m = measure(path, dtype, PROMPTS, args.tokens)
                print(
                    f"{name:<12} {dtype:<9} {m['agree']:7.3f} {m['dlp']:8.4f} {m['max']:8.4f} "
                    f"{m['free']:7.3f}"
                )


if __name__ == "__main__":
    main()
