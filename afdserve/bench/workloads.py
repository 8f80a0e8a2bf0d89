"""The prompts `afdserve bench generate` sends: random token ids, or code-edit-like prompts that
repeat their own text, on which n-gram speculation (engine/speculative.py) finds its drafts.

A workload's prompts for a batch depend only on the seed and the batch, so a run with
speculation and one without (`--compare-no-speculation`) are sent the same prompts.
"""

from __future__ import annotations

import torch

WORKLOADS = ("random", "repetitive")
# A repetitive prompt is its snippet and then edited copies of it: about this many copies in all,
# the last cut short, so that the prompt ends part way through a copy (as a file being rewritten
# does: what comes next is the rest of the text already seen).
COPIES = 3
# Each token of a copy is replaced by a random one with this probability (the edits).
EDIT_PROBABILITY = 1 / 16


def random_prompts(
    vocab_size: int, batch: int, input_len: int, gen: torch.Generator
) -> list[list[int]]:
    return torch.randint(0, vocab_size, (batch, input_len), generator=gen).tolist()


def repetitive_prompts(
    vocab_size: int, batch: int, input_len: int, gen: torch.Generator
) -> list[list[int]]:
    """Per request, a random snippet of ceil(input_len / COPIES) token ids followed by copies of
    it, each with about one token in 16 replaced, cut at `input_len` tokens."""
    snippet_len = -(-input_len // COPIES)
    copies = -(-input_len // snippet_len)
    prompts = []
    for _ in range(batch):
        snippet = torch.randint(0, vocab_size, (snippet_len,), generator=gen)
        text = snippet.repeat(copies)
        edited = torch.rand(text.shape, generator=gen) < EDIT_PROBABILITY
        edited[:snippet_len] = False  # the snippet itself is the original
        replacements = torch.randint(0, vocab_size, text.shape, generator=gen)
        prompts.append(torch.where(edited, replacements, text)[:input_len].tolist())
    return prompts


def workload_prompts(
    workload: str, vocab_size: int, batch: int, input_len: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up prompts, timed prompts) of `batch` requests: the same for the same arguments."""
    if workload not in WORKLOADS:
        raise ValueError(f"bench.workload={workload!r} is not allowed: one of {WORKLOADS}")
    make = random_prompts if workload == "random" else repetitive_prompts
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch)
    return make(vocab_size, batch, input_len, gen), make(vocab_size, batch, input_len, gen)
