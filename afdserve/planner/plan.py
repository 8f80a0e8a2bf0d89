"""`afdserve plan`: every deployment of `--gpus` that fits, its predicted step, TPOT, largest
batch and tokens/s per GPU, ranked; `--check` sets the profile's (and `--measured`'s) measured
steps against the prediction."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from afdserve.config_args import add_dataclass_arguments, build, option
from afdserve.model.config import ModelConfig
from afdserve.model.families import parse_model_config
from afdserve.model.presets import LAYERS_SEP, PRESETS, hf_config_of
from afdserve.planner.deployments import Deployment, enumerate_deployments
from afdserve.planner.kernels import dispatch_note, running_expert_kernels
from afdserve.planner.memory import ModelBytes, max_batch, model_bytes
from afdserve.planner.predict import StepPrediction, predict_step
from afdserve.planner.profile import Costs, ModelShape, Profile, ValidationPoint

TRANSPORTS = ("ipc", "nccl")
# What `--check` counts as a step predicted right (issue 27's target).
CHECK_TOLERANCE = 0.10
# Profiles measured by `afdserve bench calibrate` and shipped, one per (device, model).
SHIPPED = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class PlanSpec:
    gpus: int = option(help="GPUs of the deployment (one host or several)")
    context_len: int = option(help="prompt tokens per request")
    output_len: int = option(help="generated tokens per request (the decode context grows by it)")
    model_dir: str | None = option(None, flag="--model", help="a Hugging Face model directory")
    preset: str | None = option(None, choices=sorted(PRESETS), help="a published config")
    tpot_ms: float | None = option(
        None,
        help="the time per output token to meet: each deployment runs the largest batch "
        "whose predicted step is within it",
        shown="none: the largest batch that fits",
    )
    profile: str | None = option(
        None,
        help="the JSON of `afdserve bench calibrate`",
        shown="the shipped profile of this model, if any",
    )
    transport: str = option(
        "ipc", choices=TRANSPORTS, help="the data plane between GPUs of one world"
    )
    dtype: str = option("bfloat16", choices=("bfloat16", "float16"), help="the weights' dtype")
    kv_cache_dtype: str = option("auto", choices=("auto", "fp8"), help="the KV cache's dtype")
    gpu_memory_utilization: float = option(0.9, help="share of each GPU's memory a rank may use")
    max_num_seqs: int = option(256, help="the most sequences one attention rank runs")
    top: int = option(20, help="deployments printed (all go to --json)")
    json_out: str | None = option(
        None, flag="--json", metavar="FILE", help="write every deployment's prediction as JSON"
    )
    plot: str | None = option(
        None,
        metavar="FILE.png",
        help="tokens/s per GPU against TPOT, one point per deployment "
        "(needs matplotlib: pip install afdserve[plot])",
    )
    check: bool = option(
        False,
        help="print the profile's measured steps (and --measured's) "
        "against the prediction, instead of a plan",
    )
    measured: str | None = option(
        None,
        metavar="FILE",
        help="more measured steps for --check: a JSON list of ValidationPoint objects",
    )

    def __post_init__(self) -> None:
        if (self.model_dir is None) == (self.preset is None):
            raise ValueError("plan: give exactly one of --model DIR and --preset NAME")
        for name in ("gpus", "context_len", "output_len", "max_num_seqs", "top"):
            if getattr(self, name) < 1:
                raise ValueError(f"plan.{name}={getattr(self, name)} is not allowed: >= 1")
        if self.tpot_ms is not None and self.tpot_ms <= 0:
            raise ValueError(f"plan.tpot_ms={self.tpot_ms} is not allowed: > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"plan.gpu_memory_utilization={self.gpu_memory_utilization} is "
                f"not allowed: in (0, 1]"
            )


@dataclass(frozen=True)
class PlanRow:
    deployment: str
    attention: int
    ffn: int
    expert_parallel: bool
    ubatches: int
    worlds: int  # copies of the world on the GPUs (GPUs left over stay idle)
    batch: int  # per attention rank
    max_batch: int  # what the KV memory of an attention rank allows
    step_ms: float  # = TPOT in steady decode
    tokens_per_s_per_gpu: float
    tokens_per_s: float
    busier: str
    attention_busy_ms: float
    ffn_busy_ms: float


def model_of(spec: PlanSpec) -> tuple[ModelConfig, str]:
    """The planned model's config and the name its shipped profile is looked up by."""
    config = parse_model_config(hf_config_of(spec.preset, spec.model_dir))
    return config, spec.preset or Path(spec.model_dir).name


def load_profile(spec: PlanSpec, config: ModelConfig, name: str) -> Profile:
    if spec.profile is not None:
        profile = Profile.load(spec.profile)
    else:
        shipped = sorted(SHIPPED.glob(f"*{name}*.json")) if SHIPPED.is_dir() else []
        if not shipped:
            raise ValueError(
                f"no profile for {name}: measure one with `afdserve bench calibrate "
                f"--preset|--model ... --out FILE` on the GPU and pass --profile FILE"
            )
        profile = Profile.load(shipped[-1])
    m = profile.model
    mine = (config.num_layers, config.num_experts, config.top_k)
    if (m.num_layers, m.num_experts, m.top_k) != mine and not first_layers_of(m, config, name):
        raise ValueError(
            f"profile {spec.profile or 'shipped'} was measured on {m.name} "
            f"({m.num_layers} layers, {m.num_experts} experts, top {m.top_k}), "
            f"not this model {mine}: calibrate on it (or, where no GPU holds it whole, on its "
            f"first layers: `bench calibrate --preset NAME:LAYERS`)"
        )
    return profile


def first_layers_of(measured: ModelShape, config: ModelConfig, name: str) -> bool:
    """Whether a profile was measured on this model's first layers (`bench calibrate --preset
    NAME:LAYERS`, for a model no GPU holds whole): then its per-layer costs plan every layer."""
    base, sep, _ = measured.name.partition(LAYERS_SEP)
    return (
        bool(sep)
        and base == name.partition(LAYERS_SEP)[0]
        and (measured.num_experts, measured.top_k) == (config.num_experts, config.top_k)
        and measured.num_layers <= config.num_layers
    )


def _rows_of(
    d: Deployment, costs: Costs, sizes: ModelBytes, spec: PlanSpec, memory: float
) -> PlanRow | None:
    util, seq_tokens = spec.gpu_memory_utilization, spec.context_len + spec.output_len
    mean_context = spec.context_len + spec.output_len / 2
    if d.colocated:
        fits = max_batch(
            memory, util, sizes.colocated, sizes.kv_per_token, seq_tokens, sizes.state_per_sequence
        )
    else:
        ffn = sizes.ffn_shard(d.ffn) if d.expert_parallel else sizes.ffn
        if max_batch(memory, util, ffn, sizes.kv_per_token, 1) < 1:
            return None  # the FFN half (or its shard) does not fit a GPU
        fits = max_batch(
            memory, util, sizes.attention, sizes.kv_per_token, seq_tokens, sizes.state_per_sequence
        )
    top = min(fits, spec.max_num_seqs)
    if top < max(1, d.ubatches):
        return None

    def at(b: int) -> StepPrediction:
        return predict_step(costs, d, b, mean_context)

    batch = top
    if spec.tpot_ms is not None:  # the step grows with the batch: the largest within the target
        ok = [b for b in range(max(1, d.ubatches), top + 1) if at(b).step_ms <= spec.tpot_ms]
        if not ok:
            return None
        batch = ok[-1]
    p = at(batch)
    worlds = spec.gpus // d.gpus
    # Per GPU of the cluster: GPUs a whole number of worlds leaves over count, idle.
    total = worlds * d.attention * batch / (p.step_ms / 1e3)
    return PlanRow(
        d.name,
        d.attention,
        d.ffn,
        d.expert_parallel,
        d.ubatches,
        worlds,
        batch,
        fits,
        p.step_ms,
        total / spec.gpus,
        total,
        p.busier,
        p.attention_busy_ms,
        p.ffn_busy_ms,
    )


@dataclass(frozen=True)
class Plan:
    rows: list[PlanRow]  # best first
    profile: Profile
    sizes: ModelBytes  # of the planned model, at its full depth
    layers: int  # the planned model's (the profile's may be fewer: `first_layers_of`)


def plan(spec: PlanSpec) -> Plan:
    config, name = model_of(spec)
    profile = load_profile(spec, config, name)
    costs = Costs.fit(profile).at_depth(config.num_layers)
    kv = "float8_e4m3fn" if spec.kv_cache_dtype == "fp8" else None
    sizes = model_bytes(config, spec.dtype, kv)
    rows = [
        r
        for d in enumerate_deployments(spec.gpus, spec.transport)
        if (r := _rows_of(d, costs, sizes, spec, profile.memory_bytes)) is not None
    ]
    rows.sort(key=lambda r: -r.tokens_per_s_per_gpu)
    return Plan(rows, profile, sizes, config.num_layers)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def memory_lines(p: Plan, spec: PlanSpec) -> list[str]:
    """What each role holds at the planned model's full depth, against one GPU's memory."""
    s, memory = p.sizes, p.profile.memory_bytes
    room = memory * spec.gpu_memory_utilization
    lines = [
        f"weights: colocated {_gib(s.colocated)}, attention rank {_gib(s.attention)}, FFN rank "
        f"{_gib(s.ffn)} (routed experts {_gib(s.routed_experts)}, of which an expert-parallel "
        f"rank of F holds 1/F); KV {s.kv_per_token} B a token"
        + (f" + {_gib(s.state_per_sequence)} a sequence" if s.state_per_sequence else "")
        + f"; a GPU gives {_gib(room)} ({_gib(memory)} x {spec.gpu_memory_utilization})"
    ]
    whole = [role for role, n in (("colocated", s.colocated), ("FFN", s.ffn)) if n > room]
    if whole:
        lines.append(f"does not fit one GPU whole: {', '.join(whole)} (weights alone)")
    m = p.profile.model
    if m.num_layers != p.layers:
        lines.append(
            f"per-layer costs measured on {m.name} ({m.num_layers} of {p.layers} layers): "
            f"its mean layer stands for every layer"
        )
    return lines


def format_plan(p: Plan, spec: PlanSpec, top: int) -> str:
    rows, profile = p.rows, p.profile
    head = (
        f"plan: {spec.preset or spec.model_dir} on {spec.gpus} x "
        f"{profile.hardware.get('device', 'GPU')}, context {spec.context_len} + "
        f"{spec.output_len} output, {spec.transport}"
        + (f", TPOT <= {spec.tpot_ms} ms" if spec.tpot_ms else "")
        + f" (profile of {profile.date})"
    )
    lines = [
        head,
        *memory_lines(p, spec),
        "rank  deployment        worlds  batch/A  max  step_ms  tok/s/GPU   tok/s  busier",
    ]
    for i, r in enumerate(rows[:top], 1):
        lines.append(
            f"{i:4d}  {r.deployment:16s}  {r.worlds:6d}  {r.batch:7d}  {r.max_batch:3d}"
            f"  {r.step_ms:7.2f}  {r.tokens_per_s_per_gpu:9.1f}  {r.tokens_per_s:6.0f}"
            f"  {r.busier}"
        )
    if not rows:
        lines.append("no deployment fits (memory) or meets the TPOT target")
    else:
        base = next((r for r in rows if r.deployment == "colocated"), None)
        if base is not None and rows[0] is not base:
            gain = rows[0].tokens_per_s_per_gpu / base.tokens_per_s_per_gpu
            lines.append(
                f"best: {rows[0].deployment}, {gain:.2f}x the tokens/s per GPU of "
                f"colocated replicas"
            )
    return "\n".join(lines)


def check_rows(
    profile: Profile, extra: list[ValidationPoint]
) -> list[tuple[ValidationPoint, float]]:
    """(measured point, predicted step ms) for every measured step of the profile and `extra`."""
    costs = Costs.fit(profile)
    out = []
    for v in (*profile.validation, *extra):
        if v.deployment == "colocated":
            d = Deployment(1, 0)
        else:
            a, f = v.deployment.removesuffix("F").split("A")
            d = Deployment(int(a), int(f), False, v.ubatches, v.transport)
        out.append((v, predict_step(costs, d, v.batch, v.context).step_ms))
    return out


def _other_kernels(v: ValidationPoint, kernels: str) -> bool:
    return bool(v.expert_kernels and kernels and v.expert_kernels != kernels)


def format_check(pairs: list[tuple[ValidationPoint, float]], kernels: str = "") -> str:
    """One line per measured step. A step predicted off by more than CHECK_TOLERANCE is marked
    MISS, and one that ran other routed-experts kernels than the profile's (`kernels`, its
    ExpertKernels.name) is marked too: the last lines count both, so a miss is read, not
    averaged away, and a miss of other kernels is not taken for one of the model."""
    lines = ["deployment  transport  ubatches  batch  context  measured_ms  predicted_ms  error"]
    for v, p in pairs:
        dep = v.deployment
        transport = "-" if dep == "colocated" else v.transport
        error = (p - v.step_ms) / v.step_ms
        lines.append(
            f"{dep:10s}  {transport:9s}  "
            f"{v.ubatches:8d}  {v.batch:5d}  {v.context:7d}  {v.step_ms:11.2f}  "
            f"{p:12.2f}  {error:+6.1%}"
            + (f"  MISS (> {CHECK_TOLERANCE:.0%})" if abs(error) > CHECK_TOLERANCE else "")
            + ("  [other kernels]" if _other_kernels(v, kernels) else "")
        )
    if pairs:
        errors = [abs(p - v.step_ms) / v.step_ms for v, p in pairs]
        within = sum(e <= CHECK_TOLERANCE for e in errors)
        lines.append(
            f"largest error {max(errors):.1%} over {len(pairs)} measured steps; "
            f"{within} of {len(pairs)} within {CHECK_TOLERANCE:.0%}"
        )
        other = sorted({v.expert_kernels for v, _ in pairs if _other_kernels(v, kernels)})
        if other:
            count = sum(_other_kernels(v, kernels) for v, _ in pairs)
            lines.append(
                f"[other kernels]: {count} steps ran {'; '.join(other)}, not the "
                f"profile's {kernels}: check them against a profile of their kernels"
            )
    return "\n".join(lines)


def _plot(rows: list[PlanRow], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'afdserve[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        ax.scatter(
            r.step_ms,
            r.tokens_per_s_per_gpu,
            s=12,
            c="black" if r.deployment == "colocated" else "tab:blue",
        )
    for r in rows[:5]:
        ax.annotate(r.deployment, (r.step_ms, r.tokens_per_s_per_gpu), fontsize=7)
    ax.set_xlabel("TPOT (ms)")
    ax.set_ylabel("output tokens/s per GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="predict the deployment a cluster should run, from a "
        "measured profile (afdserve bench calibrate)",
    )
    add_dataclass_arguments(p, PlanSpec)
    p.set_defaults(func=main_plan)


def _print_dispatch_note(profile: Profile) -> None:
    note = dispatch_note(profile, running_expert_kernels(profile.model.dtype))
    if note:
        print(note)


def main_plan(args: argparse.Namespace) -> int:
    spec = build(PlanSpec, args)
    if spec.check:
        profile = load_profile(spec, *model_of(spec))
        extra = []
        if spec.measured:
            extra = [ValidationPoint(**p) for p in json.loads(Path(spec.measured).read_text())]
        kernels = profile.expert_kernels.name if profile.expert_kernels else ""
        print(format_check(check_rows(profile, extra), kernels))
        _print_dispatch_note(profile)
        return 0
    result = plan(spec)
    print(format_plan(result, spec, spec.top))
    _print_dispatch_note(result.profile)
    if spec.json_out:
        rows = [asdict(r) for r in result.rows]
        Path(spec.json_out).write_text(json.dumps(rows, indent=1) + "\n")
    if spec.plot:
        _plot(result.rows, spec.plot)
    return 0
