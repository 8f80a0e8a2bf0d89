"""Which routed-experts kernels this afdserve runs (`ops.moe_experts`' dispatch), so that a plan
says when its profile's FFN points were measured under another dispatch: the FFN curve follows
the profile's kernels (profile.ExpertKernels), not the code's."""

from __future__ import annotations

from afdserve.planner.profile import ExpertKernels, Profile

# The grouped GEMM `ops.moe_experts` takes past the decode kernels (on CUDA, bf16/fp16).
GROUPED = "triton_grouped_moe"
# The smallest padded pair list of the decode kernels (triton_moe.moe_experts: PAIRS_PAD).
MIN_PAD_PAIRS = 64


def running_expert_kernels(dtype: str) -> ExpertKernels | None:
    """This afdserve's dispatch on CUDA for `dtype` weights; None where the decode kernels do
    not run (float32) or cannot be read here (no triton)."""
    if dtype not in ("bfloat16", "float16"):
        return None
    try:
        from afdserve.kernels.moe import decode as triton_moe
    except ImportError:
        return None
    return ExpertKernels(
        triton_moe.MAX_PAIRS,
        GROUPED,
        MIN_PAD_PAIRS,
        "kernels/triton_moe.MAX_PAIRS, ops.moe_experts' dispatch",
    )


def dispatch_note(profile: Profile, running: ExpertKernels | None) -> str | None:
    """One line when the profile's FFN points ran other experts' kernels than `running` (or
    do not say which), naming the row counts whose FFN half is predicted for the profile's."""
    measured = profile.expert_kernels
    if running is None:
        return None
    redo = "re-run `afdserve bench calibrate` for this code's"
    if measured is None:
        return (
            f"note: the profile does not say which experts' kernels its FFN points ran; "
            f"this afdserve runs {running.name}: {redo}"
        )
    if (measured.decode_max_pairs, measured.grouped) == (running.decode_max_pairs, running.grouped):
        return None
    k = profile.model.top_k
    lo = min(measured.decode_max_pairs, running.decode_max_pairs) // k + 1
    if measured.grouped != running.grouped:
        rows = f"{lo} rows and more"
    else:
        rows = f"{lo}-{max(measured.decode_max_pairs, running.decode_max_pairs) // k} rows"
    return (
        f"note: the profile's FFN points ran {measured.name}; this afdserve runs "
        f"{running.name}: FFN halves of {rows} are predicted for the profile's kernels "
        f"({redo})"
    )
