"""The deployments `afdserve plan` weighs on N GPUs: colocated replicas (one per GPU, the
data-parallel baseline every AFD claim must beat) and every xAyF world of A + F <= N GPUs, with and
without expert parallelism on the FFN side, with 1-4 ubatches. A world smaller than N runs as
N // (A + F) copies, and the GPUs left over count as idle in its tokens/s per GPU."""

from __future__ import annotations

from dataclasses import dataclass

UBATCHES = (1, 2, 3, 4)


@dataclass(frozen=True)
class Deployment:
    attention: int  # A: attention ranks of one world (colocated: 1, the replica)
    ffn: int  # F: FFN ranks of one world (colocated: 0)
    expert_parallel: bool = False
    ubatches: int = 1
    transport: str = "ipc"

    @property
    def colocated(self) -> bool:
        return self.ffn == 0

    @property
    def gpus(self) -> int:
        return self.attention + self.ffn

    @property
    def name(self) -> str:
        if self.colocated:
            return "colocated"
        ep = " EP" if self.expert_parallel else ""
        return f"{self.attention}A{self.ffn}F{ep} u{self.ubatches}"


def enumerate_deployments(gpus: int, transport: str = "ipc") -> list[Deployment]:
    if gpus < 1:
        raise ValueError(f"gpus={gpus} is not allowed: an integer >= 1")
    out = [Deployment(1, 0, transport=transport)]
    for a in range(1, gpus):
        for f in range(1, gpus - a + 1):
            # Without expert parallelism an FFN rank serves attention ranks r with r mod F == f:
            # F > A leaves FFN ranks idle, so only an expert-parallel group may be wider than A.
            for ep in (False, True):
                if (f > a and not ep) or (ep and f == 1):
                    continue
                out += [Deployment(a, f, ep, u, transport) for u in UBATCHES]
    return out
