"""What several benches share: the errors of their specs, the model directory of a preset, the
warm-up and the device timer of the decode benches, and how a bench prints and writes its
results."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict

import torch

from afdserve.model.presets import parse_preset, write_preset_config

# Steps each decode batch runs before timing; the first of them captures the graph, if any.
WARMUP_STEPS = 3


def invalid(spec: object, field: str, allowed: str) -> ValueError:
    """The error of a bench spec's field: its name, its value, and what is allowed."""
    return ValueError(f"bench.{field}={getattr(spec, field)!r} is not allowed: {allowed}")


@contextlib.contextmanager
def model_dir_for(model_dir: str | None, preset: str | None, load_format: str) -> Iterator[str]:
    """The model directory: `model_dir`, or a temporary one holding the preset's config.json
    (dummy weights only: a preset has no checkpoint)."""
    if (model_dir is None) == (preset is None):
        raise ValueError("bench.model_dir: give exactly one of --model DIR and --preset NAME")
    if model_dir is not None:
        yield model_dir
        return
    try:
        parse_preset(preset)
    except ValueError as e:
        raise ValueError(f"bench.{e}") from None
    if load_format != "dummy":
        raise ValueError(
            f"bench.load_format={load_format!r} is not allowed with --preset: "
            f"'dummy' (a preset has no checkpoint)"
        )
    with tempfile.TemporaryDirectory(prefix=f"afdserve-{preset}-") as tmp:
        yield str(write_preset_config(preset, tmp))


class Timer:
    """Device time from construction to `stop()`: CUDA events on CUDA, wall time elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.t0
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def device_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of device time `fn` takes (see Timer)."""
    timer = Timer(device)
    fn()
    return timer.stop()


def report(
    bench: str, name: str, spec: object, header: str, rows: Sequence, path: str | None
) -> None:
    """Print the header and a line per row; with `path`, write the spec and the rows as JSON."""
    print(header)
    for row in rows:
        print(row.line())
    if path:
        record = {
            "bench": bench,
            "model": name,
            **asdict(spec),
            "results": [row.as_dict() for row in rows],
        }
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
