"""Where a served engine's decode step spends its host time: the engine's own step loop
(`LLM`, colocated, the server's engine minus its process hop), at a steady batch, under
cProfile. Prints the mean step (unprofiled, then profiled), the time spent in the calls that
wait for the GPU (a pageable copy to the device waits for the stream, as `tolist` does), and
the engine's functions by cumulative time: the host's serial share of a step, read off one run.

    PYTHONPATH=. python tools/host_profile.py --preset deepseek-v4-flash:4 --batch 4 \
        [--graph-mode full] [--steps 200]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from afdserve.engine.sampling_params import SamplingParams
from afdserve.llm import LLM

p = argparse.ArgumentParser()
p.add_argument("--preset", required=True)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--prompt-len", type=int, default=1024)
p.add_argument("--steps", type=int, default=200)
p.add_argument("--graph-mode", default="full")
p.add_argument("--max-model-len", type=int, default=8192)
p.add_argument("--rows", type=int, default=35)
a = p.parse_args()

model_dir = Path(tempfile.mkdtemp()) / "model"
subprocess.run(
    [sys.executable, "-m", "afdserve.cli", "make-config", "--preset", a.preset, str(model_dir)],
    check=True,
    stdout=subprocess.DEVNULL,
)
llm = LLM(
    model=str(model_dir),
    load_format="dummy",
    graph_mode=a.graph_mode,
    max_model_len=a.max_model_len,
)
prompts = [
    {"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(a.prompt_len)]}
    for i in range(a.batch)
]
params = SamplingParams(max_tokens=a.steps, ignore_eos=True, temperature=0.0)
llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
start = time.perf_counter()
llm.generate(prompts, params)
plain = time.perf_counter() - start
profiler = cProfile.Profile()
start = time.perf_counter()
profiler.enable()
llm.generate(prompts, params)
profiler.disable()
wall = time.perf_counter() - start
stats = pstats.Stats(profiler)
# The one prefill step is in the wall too: a batch of prompt_len rows, small beside the steps.
waited = sum(
    row[3]
    for key, row in stats.stats.items()  # type: ignore[attr-defined]
    if key[2]
    in (
        "<built-in method torch.tensor>",
        "<method 'tolist' of 'torch._C.TensorBase' objects>",
        "<method 'item' of 'torch._C.TensorBase' objects>",
        "<method 'cpu' of 'torch._C.TensorBase' objects>",
    )
)
print(
    f"{a.preset} batch {a.batch} graph {a.graph_mode}: {plain / a.steps * 1e3:.2f} ms a step "
    f"({a.steps} steps and one prefill), {wall / a.steps * 1e3:.2f} ms profiled, of which in "
    f"calls that wait for the GPU "
    f"{waited / a.steps * 1e3:.2f} ms a step"
)
stats.sort_stats("tottime").print_stats(a.rows)
stats.sort_stats("cumulative").print_stats("afdserve/(engine|frontend|layout|model)", a.rows)
llm.shutdown()
