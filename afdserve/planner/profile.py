"""The measured costs the planner predicts from, as one JSON file (`afdserve bench calibrate`
writes it), and the cost curves drawn through them.

What a profile holds, all on one GPU of the machine at hand, CUDA graphs on:
- `attention`: decode steps of an attention rank alone (its half of every layer, the FFN half
  answering zeros at once), per batch and context: embedding, layers, lm_head, greedy pick;
- `ffn`: the FFN half of every layer over `tokens` rows with every routed expert held;
- `fixed`: the per-step work outside the layers (embedding, final norm, lm_head, greedy pick);
- `handover`: per layer and ubatch, what handing the rows to the FFN half and back adds, per
  transport (us);
- `validation`: measured steps of whole deployments (colocated, in-process 1A1F, two-GPU 1A1F),
  which the curves are not drawn through: `afdserve plan --check` sets them against the
  prediction.

The curves are piecewise linear through the points (the kernels switch paths with the batch, so
no one formula holds): the FFN half per layer in tokens; the attention half per layer in batch
at each measured context, and linear in context between (and beyond) the measured contexts. Past
the last point a curve goes on with its last slope. An expert-parallel shard of `held` of `E`
experts does held / E of the FFN half's work over the rows it gathers (its experts receive that
share of the routed pairs, and read that share of the weights).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILE_VERSION = 1


@dataclass(frozen=True)
class StepPoint:
    batch: int
    context: int
    step_ms: float


@dataclass(frozen=True)
class FFNPoint:
    tokens: int
    step_ms: float  # the FFN half of every layer, all experts held


@dataclass(frozen=True)
class FixedPoint:
    batch: int
    ms: float


@dataclass(frozen=True)
class ValidationPoint:
    """A measured decode step the fit did not use. `deployment`: "colocated", or "1A1F" with
    `transport` "inprocess" (both halves on one GPU) or a two-GPU one ("ipc", "nccl")."""

    deployment: str
    batch: int
    context: int
    step_ms: float
    ubatches: int = 1
    transport: str = "inprocess"
    source: str = ""


@dataclass(frozen=True)
class Handover:
    us_per_layer: float  # per layer and ubatch: the A2E + E2A hand-over inside a step
    source: str


@dataclass(frozen=True)
class ModelShape:
    """The model the costs were measured on (the planner refuses another)."""

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    dtype: str


@dataclass(frozen=True)
class Profile:
    date: str
    hardware: dict[str, str | float]  # device name, memory_bytes, copy_gbps
    versions: dict[str, str]
    model: ModelShape
    attention: tuple[StepPoint, ...]  # attention-rank steps alone (FFN half answering zeros)
    ffn: tuple[FFNPoint, ...]
    fixed: tuple[FixedPoint, ...]
    handover: dict[str, Handover]
    validation: tuple[ValidationPoint, ...] = ()
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version {self.version} is not allowed: this afdserve "
                             f"reads version {PROFILE_VERSION}; re-run `afdserve bench calibrate`")
        if len(self.attention) < 2 or len(self.ffn) < 2 or not self.fixed:
            raise ValueError("a profile needs at least 2 attention steps, 2 FFN points and 1 "
                             "per-step point to draw its curves")
        if "memory_bytes" not in self.hardware:
            raise ValueError("profile.hardware has no memory_bytes")

    @property
    def memory_bytes(self) -> float:
        return float(self.hardware["memory_bytes"])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @staticmethod
    def load(path: str | Path) -> Profile:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"profile {path}: cannot be read as JSON ({e})") from None
        return Profile.from_dict(raw)

    @staticmethod
    def from_dict(raw: dict) -> Profile:
        try:
            return Profile(
                date=raw["date"],
                hardware=raw["hardware"],
                versions=raw["versions"],
                model=ModelShape(**raw["model"]),
                attention=tuple(StepPoint(**p) for p in raw["attention"]),
                ffn=tuple(FFNPoint(**p) for p in raw["ffn"]),
                fixed=tuple(FixedPoint(**p) for p in raw["fixed"]),
                handover={k: Handover(**v) for k, v in raw["handover"].items()},
                validation=tuple(ValidationPoint(**p) for p in raw.get("validation", ())),
                version=raw.get("version", 0),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"profile: missing or unexpected field ({e}); a profile is what "
                             f"`afdserve bench calibrate` writes") from None


def touched(tokens: float, held: float, top_k: int, experts: int) -> float:
    """Expected distinct experts of `held` that `tokens` rows routed top_k of `experts` hit
    (uniform routing): why splitting a batch into ubatches re-reads expert weights."""
    return held * (1.0 - (1.0 - top_k / experts) ** tokens)


def interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear through (xs, ys) (xs increasing), extended by the end slopes; one point:
    a constant."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _curve(points: dict[float, float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    xs = tuple(sorted(points))
    return xs, tuple(points[x] for x in xs)


@dataclass(frozen=True)
class Costs:
    """The curves of a profile (ms)."""

    model: ModelShape
    # context -> (batches, ms per layer of the attention half)
    attention: dict[int, tuple[tuple[float, ...], tuple[float, ...]]]
    ffn: tuple[tuple[float, ...], tuple[float, ...]]  # (tokens, ms per layer)
    fixed: tuple[tuple[float, ...], tuple[float, ...]]  # (batch, ms per step)
    handover_us: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def fit(profile: Profile) -> Costs:
        L = profile.model.num_layers
        fixed = _curve({p.batch: p.ms for p in profile.fixed})
        ffn = _curve({p.tokens: p.step_ms / L for p in profile.ffn})
        by_context: dict[int, dict[float, float]] = {}
        for p in profile.attention:
            rest = p.step_ms - interpolate(*fixed, p.batch)
            by_context.setdefault(p.context, {})[p.batch] = rest / L
        attention = {c: _curve(points) for c, points in sorted(by_context.items())}
        handover = {name: h.us_per_layer for name, h in profile.handover.items()}
        return Costs(profile.model, attention, ffn, fixed, handover)

    def attention_ms(self, batch: float, context: float) -> float:
        """One layer's attention half over `batch` decoding sequences of `context` tokens."""
        contexts = tuple(self.attention)
        at = tuple(interpolate(*self.attention[c], batch) for c in contexts)
        # A curve drawn through noisy points may cross zero past its ends; a time does not.
        return max(0.0, interpolate(contexts, at, context))

    def ffn_ms(self, tokens: float, held: float | None = None) -> float:
        """One layer's FFN half over `tokens` rows, with `held` routed experts (all: None)."""
        share = 1.0 if held is None else held / self.model.num_experts
        return max(0.0, interpolate(*self.ffn, tokens)) * share

    def fixed_ms(self, batch: float) -> float:
        return max(0.0, interpolate(*self.fixed, batch))

    def colocated_step_ms(self, batch: float, context: float) -> float:
        L = self.model.num_layers
        return self.fixed_ms(batch) + L * (self.attention_ms(batch, context) + self.ffn_ms(batch))
