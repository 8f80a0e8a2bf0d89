"""What the server does with a freshly built LLM before it reports ready: greedy requests
through every rank (and on a GPU a prefill of every size whose Triton variants would otherwise
compile under the first requests), and the one start-up line that states its capacity."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import afdserve
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.tokenizer import TokenIdsOnly

if TYPE_CHECKING:
    from afdserve.llm import LLM

WARMUP_TIMEOUT_S = 600.0


def warm_up(llm: LLM) -> None:
    """Greedy requests through every rank before reporting ready: one short one, and on a GPU a
    prefill of every size in `prefill_sizes`, one at a time."""
    # A model directory without tokenizer files (a dummy-weight preset) serves token ids only.
    ids_only = isinstance(llm.tokenizer, TokenIdsOnly)
    prompts = [[0] if ids_only else (llm.encode_prompt("Hello") or [0])]
    if llm.engine_config.device.startswith("cuda"):
        engine = llm.engine
        longest = min(llm.engine_config.max_num_batched_tokens, engine.max_model_len - 2)
        # Distinct token ids per prompt, so that a prefix cache serves none of them.
        prompts += [
            [(31 * i + 7 * j) % engine.vocab_size for j in range(n)]
            for i, n in enumerate(prefill_sizes(longest), start=1)
        ]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    deadline = time.monotonic() + WARMUP_TIMEOUT_S
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"warm-up-{i}", prompt, params)
        while not any(out.finished for out in llm.engine.step()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"warm-up did not finish within {WARMUP_TIMEOUT_S:.0f} s")


def prefill_sizes(longest: int) -> list[int]:
    """Prompt lengths that make a step's Triton kernels compile each variant the first requests
    would otherwise wait for (0.3-2.4 s stalls of every running request on an H200): launches pad
    row counts to powers of two, and Triton specialises each integer on being a multiple of 16
    (and the MoE kernels on pairs = rows x top_k). Powers of two and their next two neighbours."""
    sizes, p = set(), 1
    while p <= longest:
        sizes.update(n for n in (p, p + 1, p + 2) if n <= longest)
        p *= 2
    return sorted(sizes)


def startup_summary(llm: LLM, model_name: str) -> str:
    """One line with what a reader of the log needs to know about this server's capacity."""
    engine, config = llm.engine, llm.engine_config
    limits = engine.limits
    ranks = llm.topology.attention_ranks
    kv_tokens = limits.num_blocks * limits.block_size * ranks
    full = kv_tokens / limits.max_model_len
    concurrency = min(full, config.max_num_seqs * ranks)
    dtype = config.dtype
    # One-process engines: say what "auto" resolved to.
    core = getattr(engine.core_client, "core", None)
    if dtype == "auto" and core is not None:
        dtype = f"auto ({str(core.model.dtype).removeprefix('torch.')})"
    return (
        f"afdserve {afdserve.__version__}: model {model_name!r} ({config.model}), "
        f"topology {llm.afd_config.topology} (connector {llm.afd_config.connector}), "
        f"device {config.device}, dtype {dtype}, "
        f"max_model_len {limits.max_model_len}, KV cache {kv_tokens} tokens "
        f"({ranks} attention rank(s) x {limits.num_blocks} blocks x {limits.block_size}), "
        f"max concurrency {concurrency:.1f} requests of {limits.max_model_len} tokens "
        f"(max_num_seqs {config.max_num_seqs} per rank), "
        f"prefix caching {'on' if llm.prefix_caching else 'off'}"
    )
