"""What travels attention -> FFN besides the hidden rows, as both sides of every transport read
it: the id payload's header (`HEADER` int32s: step, layer, ubatch, tile rows) ahead of one token
id per row (-1 on pad rows), the step counter on the device that a captured graph reads, the
layers whose top-k routing travels too, and the check that refuses a payload the plan did not
describe (`LayoutError`)."""

from __future__ import annotations

import time

import torch

from afdserve.model.config import ModelConfig

HEADER = 4
STEP_MODULO = 1 << 31  # the step travels as int32


class LayoutError(RuntimeError):
    """A payload that does not match the plan: names rank, layer, ubatch, expected and actual."""


def routed_layers(config: ModelConfig, gate_on_attention: bool) -> tuple[bool, ...]:
    """Per layer, whether top-k routing travels with the hidden states: the gate sits on the
    attention side and the layer has experts. Both sides of the wire read this one answer."""
    return tuple(gate_on_attention and kind != "dense" for kind in config.layer_types)


class StepCounter:
    """The step number on the device, so a captured graph reads the step it replays in."""

    def __init__(self, device: torch.device) -> None:
        self.value = torch.zeros(1, dtype=torch.int32, device=device)

    def set(self, step: int) -> None:
        self.value.fill_(step % STEP_MODULO)


def check_token_ids(ids: torch.Tensor, vocab_size: int, where: str) -> None:
    """Every id is -1 (pad) or in the vocabulary. On CUDA a device-side assert: reading the ids
    back would sync every layer (and cannot happen inside a graph)."""
    bad = (ids < -1) | (ids >= vocab_size)
    if ids.is_cuda:
        torch._assert_async(~bad.any(), "AFD payload: token id outside [-1, vocab)")
        return
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise LayoutError(
            f"{where}: token id {int(ids[row])} at row {row} is outside [-1, {vocab_size})"
        )


class WaitClock:
    """Wall seconds an attention rank's Python thread spent in the waits for its FFN rank's
    replies. On CPU (gloo) a wait blocks until the reply is here; on CUDA it only orders the
    stream, and a replayed graph never calls it, so there it reads about zero."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def time(self, wait) -> None:
        start = time.perf_counter()
        wait()
        self.seconds += time.perf_counter() - start
