"""How far online FP8 weights move a tiny model's outputs, on CPU.

For each family: a tiny random checkpoint; the reference greedy continuation of each prompt with
the checkpoint's own weights (float32, or bfloat16); then, teacher-forced on that continuation,
the same engine with `quantization="fp8"` (weights block-scaled FP8, activations in the same
dtype). Printed per family and dtype:
  agree     greedy-token agreement: the share of positions where FP8's argmax is the reference's
  |dlp|     mean |logprob_fp8(t) - logprob_ref(t)| of the reference's token t (nats)
  bf16 |dlp| (float32 rows) the same for plain bf16 weights, as a yardstick of rounding alone

    PYTHONPATH=. python tools/fp8_quality.py [--tokens 32]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from afdserve import LLM, SamplingParams
from afdserve.model.tiny import FAMILIES, make_tiny_model

PROMPTS = [[7], [72, 101, 108, 108, 111], list(range(30, 58)), [256, 40, 41, 42, 200, 3, 4],
           [(17 * i) % 256 for i in range(45)], [97, 98, 99, 100, 101, 102], [255, 0, 255, 0],
           [(5 * i + 1) % 250 for i in range(20)]]  # fmt: skip
TOP = 20  # the most logprobs a request returns; the reference's token is nearly always among them


def reference(llm: LLM, tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy continuation of every prompt and the logprob of each of its tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t] for t, lp in zip(o.outputs[0].token_ids,
                                                                o.outputs[0].logprobs)])
            for o in outs]  # fmt: skip


def teacher_forced(llm: LLM, ref: list[tuple[list[int], list[float]]]) -> tuple[float, float]:
    """(agreement, mean |d logprob|) of `llm` along the reference continuations."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP)
    agree, deltas, missing = 0, [], 0
    positions = len(ref[0][0])
    for j in range(positions):
        prompts = [p + toks[:j] for p, (toks, _) in zip(PROMPTS, ref)]
        for out, (toks, lps) in zip(llm.generate(prompts, params, use_tqdm=False), ref):
            got = out.outputs[0]
            agree += got.token_ids[0] == toks[j]
            if toks[j] in got.logprobs[0]:
                deltas.append(abs(got.logprobs[0][toks[j]] - lps[j]))
            else:
                missing += 1
    if missing:
        print(f"  ({missing} reference tokens outside the top {TOP}: left out of |dlp|)")
    return agree / (positions * len(ref)), sum(deltas) / max(len(deltas), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{len(PROMPTS)} prompts x {args.tokens} tokens, teacher-forced")
    print(f"{'family':<12} {'dtype':<9} {'agree':>7} {'|dlp|':>8} {'bf16 |dlp|':>11}")
    with tempfile.TemporaryDirectory() as root:
        for family in FAMILIES:
            path = make_tiny_model(Path(root) / family, family, seed=0)
            for dtype in ("float32", "bfloat16"):
                with LLM(str(path), dtype=dtype) as llm:
                    ref = reference(llm, args.tokens)
                with LLM(str(path), dtype=dtype, quantization="fp8") as llm:
                    agree, delta = teacher_forced(llm, ref)
                yardstick = ""
                if dtype == "float32":
                    with LLM(str(path), dtype="bfloat16") as llm:
                        yardstick = f"{teacher_forced(llm, ref)[1]:11.4f}"
                print(f"{family:<12} {dtype:<9} {agree:7.3f} {delta:8.4f} {yardstick:>11}")


if __name__ == "__main__":
    main()
