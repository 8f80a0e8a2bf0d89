"""Plot decode tokens/s against batch size from `afdserve bench decode` outputs.

    python3 tools/plot_bench.py --colocated colocated.log --in-process inprocess.log \\
        --out docs/decode_tokens_per_s.png

Each log is the bench's printed table; the colocated one may carry the transformers columns
(`--compare-hf`), which become the third line. Needs matplotlib.
"""

from __future__ import annotations

import argparse
from pathlib import Path

Series = dict[int, float]  # batch -> tokens/s


def read_table(path: Path) -> tuple[Series, Series]:
    """(afdserve tokens/s, transformers tokens/s) from one bench log's table rows."""
    ours: Series = {}
    hf: Series = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) < 7 or not parts[0].isdigit():
            continue
        batch = int(parts[0])
        ours[batch] = float(parts[2])
        if len(parts) >= 9:
            hf[batch] = float(parts[7])
    if not ours:
        raise ValueError(f"{path}: no rows of a decode bench table")
    return ours, hf


def plot(lines: dict[str, Series], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    # Dashed second line: colocated and in-process 1A1F nearly coincide and must both show.
    styles = [("o", "-"), ("s", "--"), ("^", "-")]
    for (label, series), (marker, dash) in zip(lines.items(), styles, strict=False):
        batches = sorted(series)
        ax.plot(batches, [series[b] for b in batches], marker=marker, linestyle=dash, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    every = sorted({b for series in lines.values() for b in series})
    ax.set_xticks(every, [str(b) for b in every])
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--colocated", type=Path, required=True)
    parser.add_argument("--in-process", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--title",
        default="Qwen3-30B-A3B decode, context 1024, bf16, one H200 (CUDA graphs)",
    )
    args = parser.parse_args()
    colocated, hf = read_table(args.colocated)
    lines = {"afdserve colocated": colocated}
    if args.in_process is not None:
        lines["afdserve 1A1F in-process"] = read_table(args.in_process)[0]
    if hf:
        lines["transformers generate"] = hf
    plot(lines, args.title, args.out)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {len(v)} points" for k, v in lines.items()))


if __name__ == "__main__":
    main()
