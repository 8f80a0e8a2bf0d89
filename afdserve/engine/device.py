"""`device="auto"` and the check that a CUDA device can be had, as one line before anything starts.

vLLM runs on the GPU whenever there is one; so does afdserve: "auto" is CUDA when this process's
torch sees a GPU, else the CPU. An explicit "cuda" on a torch without CUDA (a CPU-only build, or
no GPU visible) is refused here, so that `afdserve serve --device cuda` prints one line and binds
no port, rather than failing inside a rank after the port is open.
"""

from __future__ import annotations

import torch

from afdserve.config import USAGES, EngineConfig


def cuda_unavailable_reason() -> str | None:
    """Why this process cannot use CUDA, or None when it can."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available():
        return (
            f"this torch ({torch.__version__}, CUDA {torch.version.cuda}) sees no GPU "
            f"(CUDA_VISIBLE_DEVICES={_visible()})"
        )
    return None


def _visible() -> str:
    import os

    return repr(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" or "cpu"; "cuda"/"cuda:N" checked against the GPUs this process sees."""
    if device == "auto":
        return "cuda" if cuda_unavailable_reason() is None else "cpu"
    if not device.startswith("cuda"):
        return device
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise ValueError(
            f"device={device!r}: {reason}; use --device cpu, or auto (the default) "
            f"to run on a GPU when there is one"
        )
    _, _, index = device.partition(":")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ValueError(
            f"device={device!r}: this process sees {count} GPU(s), cuda:0..cuda:{count - 1}"
        )
    return device


def with_batch_limits(config: EngineConfig, usage: str = "llm") -> EngineConfig:
    """`config` with max_num_seqs and max_num_batched_tokens "auto" (None) replaced by what
    they become on its device as this process sees it (config.batch_defaults: by the GPU's
    memory and name, and `usage`: "llm" offline or "server")."""
    if usage not in USAGES:
        raise ValueError(f"usage_context={usage!r}: one of {USAGES}")
    if config.max_num_seqs is not None and config.max_num_batched_tokens is not None:
        return config
    device, gpu_bytes, gpu_name = resolve_device(config.device), 0, ""
    if device.startswith("cuda"):
        # Device properties come from the driver: no context is made on the GPU.
        props = torch.cuda.get_device_properties(torch.device(device))
        gpu_bytes, gpu_name = props.total_memory, props.name
    return config.with_batch_defaults(usage, device, gpu_bytes, gpu_name)
