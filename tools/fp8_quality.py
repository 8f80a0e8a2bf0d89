"""How far each FP8 setting moves a model's outputs: online FP8 weights
(`quantization="fp8"`), the FP8 KV cache (`kv_cache_dtype="fp8"`) and the FP8 A2E rows
(`a2e_dtype="fp8"`; colocated runs the same quantize-dequantize at its FFN boundary as AFD's wire,
so a colocated engine measures it).

For each model (every tiny family on CPU, or a preset's shape with dummy weights, e.g. on the
GPU) and dtype: the reference greedy continuation of each prompt in the model dtype; then,
teacher-forced on that continuation, the same engine under each setting. Printed per model,
dtype and setting:
  agree     greedy-token agreement: the share of positions where the setting's argmax is the
            reference's
  |dlp|     mean |logprob(t) - logprob_ref(t)| of the reference's token t (nats)
  bf16 |dlp| (float32 rows of the weights setting) the same for plain bf16 weights, as a
            yardstick of rounding alone

    PYTHONPATH=. python tools/fp8_quality.py [--tokens 32] [--settings weights,kv,wire]
    PYTHONPATH=. python tools/fp8_quality.py --preset qwen3-30b-a3b --device cuda --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.tiny import FAMILIES, make_tiny_model
from afdserve.model.presets import write_preset_config

# The engine options of each setting measured against the model-dtype reference.
SETTINGS = {
    "weights": {"quantization": "fp8"},
    "kv": {"kv_cache_dtype": "fp8"},
    "wire": {"a2e_dtype": "fp8"},
}

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


def reference(llm: LLM, tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy continuation of every prompt and the logprob of each of its tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        )
        for o in outs
    ]


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
    parser.add_argument("--settings", default="weights,kv,wire")
    parser.add_argument("--preset", default=None, help="a preset's shape, dummy weights")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs to capture")
    args = parser.parse_args()
    settings = [s for s in args.settings.split(",") if s]
    if unknown := set(settings) - set(SETTINGS):
        parser.error(f"--settings: {sorted(unknown)} unknown, allowed {sorted(SETTINGS)}")
    if args.device == "cpu":
        torch.set_num_threads(1)
    print(f"{len(PROMPTS)} prompts x {args.tokens} tokens, teacher-forced, on {args.device}")
    print(f"{'model':<14} {'dtype':<9} {'setting':<8} {'agree':>7} {'|dlp|':>8} {'bf16 |dlp|':>11}")
    with tempfile.TemporaryDirectory() as root:
        if args.preset:
            models = {args.preset: (str(write_preset_config(args.preset, root)), "dummy")}
        else:
            models = {
                f: (str(make_tiny_model(Path(root) / f, f, seed=0)), "auto") for f in FAMILIES
            }
        for name, (path, load_format) in models.items():
            common = dict(
                device=args.device,
                load_format=load_format,
                seed=0,
                enforce_eager=args.enforce_eager,
            )
            for dtype in args.dtypes.split(","):
                with LLM(path, dtype=dtype, **common) as llm:
                    ref = reference(llm, args.tokens)
                for setting in settings:
                    with LLM(path, dtype=dtype, **common, **SETTINGS[setting]) as llm:
                        agree, delta = teacher_forced(llm, ref)
                    yardstick = ""
                    if dtype == "float32" and setting == "weights":
                        with LLM(path, dtype="bfloat16", **common) as llm:
                            yardstick = f"{teacher_forced(llm, ref)[1]:11.4f}"
                    print(
                        f"{name:<14} {dtype:<9} {setting:<8} {agree:7.3f} {delta:8.4f} "
                        f"{yardstick:>11}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
