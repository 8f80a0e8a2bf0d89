"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    # bool is a subclass of int; `max_tokens=True` is a caller bug, not the number 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{field}={getattr(self, field)!r}: {allowed}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not (
            math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or self.top_k >= 1):
            raise bad("top_k", "must be -1 or 0 (disabled) or an integer >= 1")
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            raise bad("top_p", "must be a number in (0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be None or an integer")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")

        # Frozen dataclass: normalise the sequence fields in place so that the stored value is
        # always a hashable tuple whatever the caller passed (str, list or tuple).
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "must be a non-empty string or a list/tuple of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))

        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise bad("stop_token_ids", "must be a list/tuple of integers >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
