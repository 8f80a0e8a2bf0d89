"""A deployment's decode step, predicted from the fitted costs (profile.py).

Colocated replica: per-step work + every layer's attention half + FFN half, one after the other.
In-process 1A1F (both halves on one GPU, the single-GPU check of the split) likewise runs
everything in turn: u * (ta + tf + hand-over) per layer.

xAyF across GPUs, per attention rank a batch of b sequences in u ubatches of b / u: each FFN rank
serves the ceil(A / F) attention ranks whose home it is and runs the FFN half once per ubatch
over all their rows (an expert-parallel group: over the group's gathered rows, F times the
largest receive, with E / F experts held). The layer loop is layer-major and ubatch-minor, so per
layer the attention GPU works u * ta, the FFN GPU u * tf, and each ubatch's own chain ta + tf plus
its hand-over must fit in the layer too: the layer takes the largest of the three. Each role
pays the whole hand-over per ubatch (its own send and its wait for the peer's reply).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from afdserve.planner.deployments import Deployment
from afdserve.planner.profile import Costs


@dataclass(frozen=True)
class StepPrediction:
    step_ms: float
    attention_busy_ms: float  # per step, one attention GPU
    ffn_busy_ms: float  # per step, the busiest FFN GPU

    @property
    def busier(self) -> str:
        return "attention" if self.attention_busy_ms >= self.ffn_busy_ms else "ffn"


def _handover_ms(costs: Costs, transport: str) -> float:
    if transport not in costs.handover_us:
        raise ValueError(
            f"transport={transport!r}: the profile has no hand-over cost for it; "
            f"it has {sorted(costs.handover_us)}"
        )
    return costs.handover_us[transport] / 1e3


def ffn_ubatch_ms(costs: Costs, d: Deployment, rows: float) -> float:
    """One layer's FFN half on the busiest FFN rank for one ubatch of `rows` per attention
    rank."""
    homes = math.ceil(d.attention / d.ffn)  # attention ranks sharing the busiest home rank
    if not d.expert_parallel:
        return costs.ffn_ms(homes * rows)
    gathered = d.ffn * homes * rows  # the group's all-gather: F x the largest receive
    own = costs.ffn_ms(gathered, held=costs.model.num_experts / d.ffn)
    # The all-gather + reduce-scatter inside the group is not measured on one GPU: costed as
    # one more hand-over of the same transport.
    return own + _handover_ms(costs, d.transport)


def predict_step(costs: Costs, d: Deployment, batch: float, context: float) -> StepPrediction:
    L = costs.model.num_layers
    fixed = costs.fixed_ms(batch)
    if d.colocated:
        ta, tf = costs.attention_ms(batch, context), costs.ffn_ms(batch)
        return StepPrediction(fixed + L * (ta + tf), fixed + L * (ta + tf), 0.0)
    u = d.ubatches
    rows = batch / u
    ta = costs.attention_ms(rows, context)
    tf = ffn_ubatch_ms(costs, d, rows)
    h = _handover_ms(costs, d.transport)
    if d.transport == "inprocess":
        step = fixed + L * u * (ta + tf + h)
        return StepPrediction(step, fixed + L * u * ta, L * u * tf)
    attention_busy = u * (ta + h)
    ffn_busy = u * (tf + h)
    layer = max(attention_busy, ffn_busy, ta + tf + h)
    return StepPrediction(fixed + L * layer, fixed + L * attention_busy, L * ffn_busy)
