"""What the benches report of speculative decoding: the engine's own acceptance counters over a
timed run (`bench generate`), and a verification step's time against a plain decode step with
the speedup those times give at a given acceptance rate (`bench decode --num-speculative-tokens`).

The arithmetic is the usual one for k drafts each accepted with probability `a`, independently
and in order: a step yields 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens on average, and
costs `verify_ms / plain_ms` plain steps, so speculation yields that many tokens per plain step's
time. The drafts' own cost is left out where they were not run: n-gram lookup runs on the CPU
between steps, and an MTP draft is one decoder layer a draft token, about 1 / num_layers of a
step each; on a model with MTP layers the timed step runs its draft passes (`mtp_timed`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import zip_longest

from afdserve.frontend.core_client import EngineStats

# The acceptance rates `bench decode` turns its step times into speedups at.
ACCEPTANCE_RATES = (0.6, 0.8)


@dataclass(frozen=True)
class SpecCounts:
    """vLLM's vllm:spec_decode_* counters (every attention rank together) over one run."""

    num_drafts: int  # sequences verified with at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # [k]: drafts whose i-th token was accepted

    @classmethod
    def of(cls, stats: EngineStats) -> SpecCounts:
        accepted, drafted, drafts = stats.spec_totals
        ranks = [s.accepted_per_pos for s in stats.spec_decode.values()]
        return cls(drafts, drafted, accepted, tuple(map(sum, zip(*ranks, strict=True))))

    def since(self, before: SpecCounts) -> SpecCounts:
        # A count no rank had reported yet is 0 (zip_longest's fill).
        per_pos = zip_longest(self.accepted_per_pos, before.accepted_per_pos, fillvalue=0)
        return SpecCounts(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            tuple(a - b for a, b in per_pos),
        )

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens (vLLM's "Draft acceptance rate")."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verification yields on average: its accepted drafts and the one it adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }

    def text(self) -> str:
        rate = self.acceptance_rate
        shown = "-" if rate is None else f"{rate:.1%}"
        return (
            f"acceptance {shown} ({self.num_accepted_tokens} of {self.num_draft_tokens} draft "
            f"tokens in {self.num_drafts} drafts; accepted per position "
            f"{list(self.accepted_per_pos)})"
        )


def expected_tokens(acceptance_rate: float, k: int) -> float:
    """Tokens one verification of k drafts yields when each is accepted with probability `a`."""
    a = acceptance_rate
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


@dataclass(frozen=True)
class VerifyResult:
    """A verification step (1 + k rows a sequence) against a plain decode step, same batch."""

    batch: int
    k: int
    plain_ms: float
    verify_ms: float
    # Of the whole target model (a preset's published count, whatever layers were timed): an MTP
    # draft layer costs about 1 / num_layers of a step.
    num_layers: int
    # The model's k MTP draft passes ran inside each timed verification step (so verify_ms
    # holds their cost, and no estimate is added for them).
    mtp_timed: bool = False
    # With MTP timed: the same verification step with no draft pass run, so the drafts' share
    # (verify_ms - this) and the verification's own (this / plain_ms) read apart. On a preset's
    # first layers a draft layer weighs 1 / LAYERS of the step, not 1 / num_layers.
    alone_ms: float | None = None

    @property
    def cost(self) -> float:
        """A verification step in plain steps."""
        return self.verify_ms / self.plain_ms

    def speedup(self, acceptance_rate: float, draft_cost: float = 0.0) -> float:
        """Tokens per plain step's time with speculation; `draft_cost` in plain steps."""
        return expected_tokens(acceptance_rate, self.k) / (self.cost + draft_cost)

    @property
    def alone_cost(self) -> float | None:
        """The verification step without its draft passes, in plain steps."""
        return None if self.alone_ms is None else self.alone_ms / self.plain_ms

    @property
    def mtp_cost(self) -> float:
        """k MTP layers, at about one decoder layer's share of a plain step each (0 where the
        step timed them)."""
        return 0.0 if self.mtp_timed else self.k / self.num_layers

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "verify_over_plain": self.cost,
            "alone_over_plain": self.alone_cost,
            "speedup": {str(a): self.speedup(a) for a in ACCEPTANCE_RATES},
            "speedup_with_mtp_draft": {
                str(a): self.speedup(a, self.mtp_cost) for a in ACCEPTANCE_RATES
            },
        }


def format_verify_table(results: list[VerifyResult]) -> str:
    rates = "".join(f"  x@a={a}   +MTP" for a in ACCEPTANCE_RATES)
    alone = any(r.alone_ms is not None for r in results)
    split = "  alone_ms  alone/plain" if alone else ""
    lines = [f"batch  k  plain_ms  verify_ms  verify/plain{split}{rates}"]
    for r in results:
        speedups = "".join(
            f"  {r.speedup(a):6.2f}x {r.speedup(a, r.mtp_cost):5.2f}x" for a in ACCEPTANCE_RATES
        )
        parts = ""
        if alone:
            parts = (
                f"  {'-':>8}  {'-':>11}"
                if r.alone_ms is None
                else f"  {r.alone_ms:8.2f}  {r.alone_cost:10.2f}x"
            )
        lines.append(
            f"{r.batch:5d}  {r.k}  {r.plain_ms:8.2f}  {r.verify_ms:9.2f}  {r.cost:11.2f}x"
            f"{parts}{speedups}"
        )
    if results and results[0].mtp_timed:
        lines.append(
            "verify_ms includes the model's k MTP draft passes (same graph mode); alone_ms is "
            "the same step with no draft pass run, so the drafts take verify_ms - alone_ms; x@a: "
            "speedup at acceptance rate a = (1 - a^(k+1)) / (1 - a) tokens a step over "
            "verify/plain, the drafts' cost included (+MTP adds nothing more)"
        )
    elif results:
        lines.append(
            "x@a: speedup at acceptance rate a = (1 - a^(k+1)) / (1 - a) tokens a step over "
            "verify/plain, the draft's cost left out; +MTP: with k MTP layers at "
            f"1/{results[0].num_layers} of a plain step each added to the step (the whole "
            "model's layers)"
        )
    return "\n".join(lines)
