"""The measured costs the planner predicts from, as one JSON file (`afdserve bench calibrate`
writes it; `Profile` says what it holds), and the cost curves drawn through them (`Costs`).

The curves are piecewise linear through the points (the kernels switch paths with the batch, so
no one formula holds): the FFN half per layer in tokens; the attention half per layer in batch
at each measured context, and linear in context between (and beyond) the measured contexts. Past
the last point a curve goes on with its last slope. An expert-parallel shard of `held` of `E`
experts does held / E of the FFN half's work over the rows it gathers (its experts receive that
share of the routed pairs, and read that share of the weights). Where the profile names the
routed-experts kernels (`expert_kernels`), the FFN curve follows them (`Costs.ffn_ms`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
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
    # The routed-experts kernels the step ran (ExpertKernels.name); "": the profile's own.
    expert_kernels: str = ""


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
    expert_bytes: int = 0  # one routed expert's weights in one layer (0: not recorded)


@dataclass(frozen=True)
class ExpertKernels:
    """Which routed-experts kernel ran at a row count when the FFN points were measured: the
    decode kernels (kernels/moe/decode.py) up to `decode_max_pairs` (token, expert) pairs, the
    grouped GEMM above.

    Every decode-kernel program holds the pair list padded to a power of two (at least
    `min_pad_pairs`) and scans it, so within one padded bucket the programs do the same work
    and only the expert weights read differ. Measured (docs/benchmarks.md, 2026-12-02): 404.6 us
    at 96 rows against 405.9 at 128 (both 1024 padded pairs, every expert touched), 296.1 at 64
    (512); and below a bucket's top the FFN half is the top's time less the untouched experts'
    read (the 1, 2 and 4-row points from the 8-row one within 4.1%)."""

    decode_max_pairs: int
    grouped: str  # the grouped GEMM above them (its module: moe_gpu, triton_grouped_moe)
    min_pad_pairs: int = 64
    source: str = ""

    @property
    def name(self) -> str:
        return f"decode kernels up to {self.decode_max_pairs} pairs, then {self.grouped}"

    def bucket(self, pairs: float) -> int | None:
        """The padded pair count of `pairs` on the decode kernels; None: the grouped GEMM."""
        if pairs > self.decode_max_pairs:
            return None
        return max(self.min_pad_pairs, 1 << max(0, math.ceil(pairs) - 1).bit_length())


@dataclass(frozen=True)
class Profile:
    """What was measured, all on one GPU of the machine at hand, CUDA graphs on:
    - `attention`: decode steps of an attention rank alone (its half of every layer, the FFN half
      answering zeros at once), per batch and context: embedding, layers, lm_head, greedy pick;
    - `ffn`: the FFN half of every layer over `tokens` rows with every routed expert held;
    - `fixed`: the per-step work outside the layers (embedding, final norm, lm_head, greedy pick);
    - `handover`: per layer and ubatch, what handing the rows to the FFN half and back adds, per
      transport (us);
    - `validation`: measured steps of whole deployments (colocated, in-process 1A1F, two-GPU
      1A1F), which the curves are not drawn through: `afdserve plan --check` sets them against
      the prediction."""

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
    # None: the FFN curve is a straight line between its points.
    expert_kernels: ExpertKernels | None = None

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(
                f"profile version {self.version} is not allowed: this afdserve "
                f"reads version {PROFILE_VERSION}; re-run `afdserve bench calibrate`"
            )
        if len(self.attention) < 2 or len(self.ffn) < 2 or not self.fixed:
            raise ValueError(
                "a profile needs at least 2 attention steps, 2 FFN points and 1 "
                "per-step point to draw its curves"
            )
        if "memory_bytes" not in self.hardware:
            raise ValueError("profile.hardware has no memory_bytes")
        if self.expert_kernels is not None and (
            self.model.expert_bytes <= 0 or not self.hardware.get("copy_gbps")
        ):
            raise ValueError(
                "profile.expert_kernels needs model.expert_bytes > 0 and "
                "hardware.copy_gbps: the decode kernels' buckets are costed by the "
                "expert weights a row count reads"
            )

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
                expert_kernels=(
                    ExpertKernels(**raw["expert_kernels"]) if raw.get("expert_kernels") else None
                ),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"profile: missing or unexpected field ({e}); a profile is what "
                f"`afdserve bench calibrate` writes"
            ) from None


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
    expert_kernels: ExpertKernels | None = None
    expert_read_ms: float = 0.0  # one routed expert's weights at the copy bandwidth

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
        read = 0.0
        if profile.expert_kernels is not None:
            read = profile.model.expert_bytes / (float(profile.hardware["copy_gbps"]) * 1e9) * 1e3
        return Costs(profile.model, attention, ffn, fixed, handover, profile.expert_kernels, read)

    def at_depth(self, layers: int) -> Costs:
        """The same per-layer costs for a model of `layers` layers: a profile measured on a
        model's first layers (`--preset NAME:LAYERS`) plans the whole model, its mean layer
        standing for every layer."""
        return replace(self, model=replace(self.model, num_layers=layers))

    def attention_ms(self, batch: float, context: float) -> float:
        """One layer's attention half over `batch` decoding sequences of `context` tokens."""
        contexts = tuple(self.attention)
        at = tuple(interpolate(*self.attention[c], batch) for c in contexts)
        # A curve drawn through noisy points may cross zero past its ends; a time does not.
        return max(0.0, interpolate(contexts, at, context))

    def ffn_ms(self, tokens: float, held: float | None = None) -> float:
        """One layer's FFN half over `tokens` rows, with `held` routed experts (all: None)."""
        share = 1.0 if held is None else held / self.model.num_experts
        return max(0.0, self._ffn_all_experts(tokens)) * share

    def _ffn_all_experts(self, tokens: float) -> float:
        """With `expert_kernels`, the curve follows the kernels instead of a straight line between
        its points: the grouped GEMM's points are interpolated among themselves only (a line from
        a decode-kernel point to a grouped one describes neither), and on the decode kernels a row
        count costs what the measured count above it in the same padded pair bucket costs, less
        the weights of the experts it does not touch (see `ExpertKernels`)."""
        kernels = self.expert_kernels
        if kernels is None:
            return interpolate(*self.ffn, tokens)
        m = self.model
        bucket = kernels.bucket(tokens * m.top_k)
        points = [(x, y) for x, y in zip(*self.ffn) if kernels.bucket(x * m.top_k) == bucket]
        if bucket is not None:
            above = [(x, y) for x, y in points if x >= tokens]
            if above:
                # The same programs over the same padded pair list: the bucket's measured count
                # above, less the weights of the experts these rows do not touch.
                x, y = above[0]
                untouched = touched(x, m.num_experts, m.top_k, m.num_experts) - touched(
                    tokens, m.num_experts, m.top_k, m.num_experts
                )
                return y - self.expert_read_ms * untouched
            # No measured count above in the bucket: a line through the decode kernels' points.
            points = [(x, y) for x, y in zip(*self.ffn) if kernels.bucket(x * m.top_k) is not None]
        # The grouped GEMM's points only (or, with none of its own kind, every point).
        if not points:
            return interpolate(*self.ffn, tokens)
        xs, ys = zip(*points)
        return interpolate(xs, ys, tokens)

    def fixed_ms(self, batch: float) -> float:
        return max(0.0, interpolate(*self.fixed, batch))

    def colocated_step_ms(self, batch: float, context: float) -> float:
        L = self.model.num_layers
        return self.fixed_ms(batch) + L * (self.attention_ms(batch, context) + self.ffn_ms(batch))
