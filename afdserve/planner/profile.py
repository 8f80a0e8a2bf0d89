"""The measured costs the planner predicts from, as one JSON file (`afdserve bench calibrate`
writes it), and the cost curves fitted to them.

What a profile holds, all on one GPU of the machine at hand:
- `colocated`: whole decode steps (batch, context -> ms), CUDA graphs on, every layer's both
  halves on one device: what a replica costs, and (less the FFN half and the per-step work) what
  the attention half costs;
- `ffn`: the FFN half of every layer over `tokens` rows with every routed expert held (ms);
- `fixed`: the per-step work outside the layers (embedding, final norm, lm_head, greedy pick);
- `handover`: per layer and ubatch, what handing the rows to the FFN half and back adds to a
  step, per transport (us);
- `validation`: measured steps the fit did not use (colocated and in-process 1A1F), which
  `afdserve plan --check` sets against the prediction.

The curves follow what a decode step reads, since it is memory-bound:
- attention half per layer: a0 + a1 * batch + a2 * batch * context (weights once, per-sequence
  work, the KV cache);
- FFN half per layer: f0 + f1 * experts_touched + f2 * tokens, with the experts a batch touches
  estimated as held * (1 - (1 - top_k / experts) ** tokens) (uniform routing);
- per-step work: g0 + g1 * batch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

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
    colocated: tuple[StepPoint, ...]
    ffn: tuple[FFNPoint, ...]
    fixed: tuple[FixedPoint, ...]
    handover: dict[str, Handover]
    validation: tuple[ValidationPoint, ...] = ()
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version {self.version} is not allowed: this afdserve "
                             f"reads version {PROFILE_VERSION}; re-run `afdserve bench calibrate`")
        if len(self.colocated) < 3 or len(self.ffn) < 3 or len(self.fixed) < 2:
            raise ValueError("a profile needs at least 3 colocated steps, 3 FFN points and 2 "
                             "per-step points to fit its curves")
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
                colocated=tuple(StepPoint(**p) for p in raw["colocated"]),
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
    """Expected distinct experts of `held` that `tokens` rows routed top_k of `experts` hit."""
    return held * (1.0 - (1.0 - top_k / experts) ** tokens)


def _lstsq(rows: list[list[float]], y: list[float]) -> tuple[float, ...]:
    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(y, dtype=float),
                               rcond=None)
    return tuple(float(c) for c in coef)


@dataclass(frozen=True)
class Costs:
    """The fitted curves of a profile (ms)."""

    model: ModelShape
    attention: tuple[float, float, float]  # a0, a1, a2
    ffn: tuple[float, float, float]  # f0, f1, f2
    fixed: tuple[float, float]  # g0, g1
    handover_us: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def fit(profile: Profile) -> Costs:
        m = profile.model
        L, E, k = m.num_layers, m.num_experts, m.top_k
        fixed = _lstsq([[1.0, p.batch] for p in profile.fixed], [p.ms for p in profile.fixed])
        ffn = _lstsq([[1.0, touched(p.tokens, E, k, E), p.tokens] for p in profile.ffn],
                     [p.step_ms / L for p in profile.ffn])
        partial = Costs(m, (0.0, 0.0, 0.0), ffn, fixed)  # type: ignore[arg-type]
        rows, y = [], []
        for p in profile.colocated:
            rest = p.step_ms - partial.fixed_ms(p.batch) - L * partial.ffn_ms(p.batch)
            rows.append([1.0, p.batch, p.batch * p.context])
            y.append(rest / L)
        attention = _lstsq(rows, y)
        handover = {name: h.us_per_layer for name, h in profile.handover.items()}
        return Costs(m, attention, ffn, fixed, handover)  # type: ignore[arg-type]

    def attention_ms(self, batch: float, context: float) -> float:
        """One layer's attention half over `batch` decoding sequences of `context` tokens."""
        a0, a1, a2 = self.attention
        # A fit to noisy points may cross zero at the edge of its range; a time does not.
        return max(0.0, a0 + a1 * batch + a2 * batch * context)

    def ffn_ms(self, tokens: float, held: float | None = None) -> float:
        """One layer's FFN half over `tokens` rows, with `held` routed experts (all: None)."""
        m = self.model
        held = m.num_experts if held is None else held
        f0, f1, f2 = self.ffn
        return max(0.0, f0 + f1 * touched(tokens, held, m.top_k, m.num_experts) + f2 * tokens)

    def fixed_ms(self, batch: float) -> float:
        g0, g1 = self.fixed
        return max(0.0, g0 + g1 * batch)

    def colocated_step_ms(self, batch: float, context: float) -> float:
        L = self.model.num_layers
        return self.fixed_ms(batch) + L * (self.attention_ms(batch, context) + self.ffn_ms(batch))
