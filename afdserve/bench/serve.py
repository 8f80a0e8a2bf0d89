"""`afdserve bench serve`: load a running server through its HTTP API, as users of vLLM's serving
benchmark do, and report what its clients see.

For each request rate, `num_prompts` requests arrive as a Poisson process (rate `inf`: all at
once), each streaming `/v1/completions` with `input_len` random token ids, `max_tokens=output_len`
and `ignore_eos`, so that each generates exactly `output_len` tokens. On the client's clock from
the moment a request is sent: TTFT until the first streamed chunk, ITL the gaps between later
chunks, TPOT (e2e - TTFT) / (output tokens - 1), e2e until the last chunk. Output tokens are the
server's `usage`, not a count of chunks (a server may merge tokens or hold back text);
throughputs divide by the wall time from the first request sent to the last one finished. Every
rate gets fresh prompts (the same on every run), so that a prefix cache gains nothing from an
earlier rate. `--num-prefixes P` shares P random prefixes of `--prefix-len` tokens among the
requests, and reports the prompt tokens served from the cache.

Only the standard library, httpx and numpy: the client runs beside any server with vLLM's
completions API, `vllm serve` included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from afdserve.bench.flags import add_json_flag, comma_list
from afdserve.config_args import add_field_argument, build, option

try:
    import httpx
except ImportError:  # the `bench` extra: `afdserve serve` and the other commands run without it
    httpx = None  # type: ignore[assignment]

PERCENTILE = 99
CONNECT_TIMEOUT_S = 60.0


parse_rates = comma_list(float, "request rates like 1,4,16,inf")


@dataclass(frozen=True)
class ServeBench:
    base_url: str = option("http://127.0.0.1:8000", help="the server")
    num_prompts: int = option(200, help="requests per rate")
    input_len: int = option(
        1024, help="prompt tokens per request (with --num-prefixes: after the prefix)"
    )
    output_len: int = option(128, help="generated tokens per request")
    # requests per second; math.inf: all at once
    request_rates: tuple[float, ...] = option(
        (math.inf,),
        flag="--request-rate",
        parse=parse_rates,
        help="comma-separated requests/s, Poisson arrivals; inf sends all at once",
    )
    # None: the first model the server lists
    model: str | None = option(None, help="served model name", shown="the first listed")
    # None: from --model-dir's (or the served root's) config.json
    vocab_size: int | None = option(
        None, help="prompt token ids are drawn from [0, N)", shown="from --model-dir"
    )
    model_dir: str | None = option(
        None,
        help="a model directory whose config.json gives the vocabulary size",
        shown="the served model's path, when the server runs here",
    )
    max_concurrency: int | None = option(
        None,
        help="requests in flight at most, later arrivals wait for a slot",
        shown="None, no limit",
    )
    seed: int = option(0, help="seed of the prompts and arrival times")
    # None on the command line: $AFDSERVE_API_KEY, then $OPENAI_API_KEY (main_serve reads them)
    api_key: str | None = option(
        None, help="Bearer token", shown="$AFDSERVE_API_KEY, then $OPENAI_API_KEY"
    )
    timeout_s: float = option(3600.0, help="seconds one request may take")
    num_prefixes: int = option(
        0,
        help="the shared-prefix workload: P random prefixes, each request one of them plus "
        "--input-len tokens of its own; 0: every prompt is random",
        metavar="P",
    )
    prefix_len: int = option(
        256, help="tokens of each shared prefix (with --num-prefixes)", metavar="L"
    )

    @property
    def prompt_len(self) -> int:
        return self.input_len + (self.prefix_len if self.num_prefixes else 0)

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"bench serve: {name}={value!r}: must be an integer >= 1")
        if not self.request_rates or any(not rate > 0 for rate in self.request_rates):
            raise ValueError(
                f"bench serve: request_rates={self.request_rates!r}: numbers > 0 "
                f"(or inf), e.g. 1,4,16,inf"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"bench serve: max_concurrency={self.max_concurrency}: must be >= 1")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"bench serve: vocab_size={self.vocab_size}: must be >= 1")
        if not isinstance(self.num_prefixes, int) or self.num_prefixes < 0:
            raise ValueError(f"bench serve: num_prefixes={self.num_prefixes!r}: must be >= 0")
        if not isinstance(self.prefix_len, int) or self.prefix_len < 1:
            raise ValueError(f"bench serve: prefix_len={self.prefix_len!r}: must be >= 1")


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server served from its prefix cache
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True)
class RateResult:
    request_rate: float
    duration_s: float
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output tokens) / s
    # metric -> {"mean", "median", "p99"} in milliseconds; None when nothing was measured
    ms: dict[str, dict[str, float] | None]
    requests: list[RequestResult]


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def shared_prefix_prompts(
    count: int, num_prefixes: int, prefix_len: int, suffix_len: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """`count` prompts, each one of `num_prefixes` random prefixes of `prefix_len` tokens (in
    turn, then shuffled) plus `suffix_len` random tokens of its own."""
    rng = random.Random(seed)
    prefixes = random_prompts(num_prefixes, prefix_len, vocab_size, rng.randrange(2**32))
    order = [i % num_prefixes for i in range(count)]
    rng.shuffle(order)
    return [prefixes[k] + [rng.randrange(vocab_size) for _ in range(suffix_len)] for k in order]


def bench_prompts(spec: ServeBench, count: int, vocab_size: int, seed: int) -> list[list[int]]:
    if spec.num_prefixes:
        return shared_prefix_prompts(
            count, spec.num_prefixes, spec.prefix_len, spec.input_len, vocab_size, seed
        )
    return random_prompts(count, spec.input_len, vocab_size, seed)


def arrival_offsets(count: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds after the start at which each request is sent: exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * count
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


async def send(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    """One streamed completion, timed on the client's clock."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_len=len(prompt))
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:500]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:500]
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                elif chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_tokens = int(usage["completion_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:  # transport or a bad chunk
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = (last if last is not None else time.perf_counter()) - start
    result.ok = last is not None and result.output_tokens > 0
    if not result.ok:
        result.error = "no streamed chunk" if last is None else "no usage in the stream"
    return result


async def run_rate(
    client: httpx.AsyncClient,
    spec: ServeBench,
    model: str,
    prompts: list[list[int]],
    rate: float,
    seed: int,
) -> RateResult:
    offsets = arrival_offsets(len(prompts), rate, random.Random(seed))
    slots = asyncio.Semaphore(spec.max_concurrency or len(prompts))

    async def one(prompt: list[int]) -> RequestResult:
        async with slots:
            return await send(client, model, prompt, spec.output_len)

    tasks = []
    start = time.perf_counter()
    for prompt, offset in zip(prompts, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(prompt)))
    results = await asyncio.gather(*tasks)
    return summarize(rate, results, time.perf_counter() - start)


def _stats_ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ms = np.asarray(values) * 1000.0
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        f"p{PERCENTILE}": float(np.percentile(ms, PERCENTILE)),
    }


def summarize(rate: float, results: list[RequestResult], duration_s: float) -> RateResult:
    done = [r for r in results if r.ok]
    inputs = sum(r.prompt_len for r in done)
    outputs = sum(r.output_tokens for r in done)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return RateResult(
        request_rate=rate,
        duration_s=duration_s,
        completed=len(done),
        failed=len(results) - len(done),
        input_tokens=inputs,
        output_tokens=outputs,
        cached_tokens=sum(r.cached_tokens for r in done),
        request_throughput=len(done) / duration_s,
        output_throughput=outputs / duration_s,
        total_token_throughput=(inputs + outputs) / duration_s,
        ms={
            "ttft": _stats_ms([r.ttft_s for r in done]),
            "tpot": _stats_ms(tpots),
            "itl": _stats_ms([gap for r in done for gap in r.itl_s]),
            "e2e": _stats_ms([r.e2e_s for r in done]),
        },
        requests=list(results),
    )


METRIC_NAMES = {
    "ttft": "TTFT",
    "tpot": "TPOT (after the first token)",
    "itl": "ITL",
    "e2e": "E2E latency",
}


def _rate_name(rate: float) -> str:
    return "inf (all at once)" if math.isinf(rate) else f"{rate:g} req/s (Poisson)"


def format_rate(r: RateResult, num_prompts: int) -> str:
    lines = [
        f"---- request rate {_rate_name(r.request_rate)} ----",
        f"{'completed requests':<30}{r.completed} of {num_prompts}",
        f"{'duration':<30}{r.duration_s:.2f} s",
        f"{'input / output tokens':<30}{r.input_tokens} / {r.output_tokens}",
        f"{'cached input tokens':<30}{r.cached_tokens}"
        f" ({r.cached_tokens / max(r.input_tokens, 1):.1%})",
        f"{'request throughput':<30}{r.request_throughput:.2f} req/s",
        f"{'output token throughput':<30}{r.output_throughput:.1f} tokens/s",
        f"{'total token throughput':<30}{r.total_token_throughput:.1f} tokens/s",
        f"{'(ms)':<30}{'mean':>10}{'median':>10}{f'p{PERCENTILE}':>10}",
    ]
    for key, name in METRIC_NAMES.items():
        s = r.ms[key]
        cells = (
            ("-", "-", "-")
            if s is None
            else (f"{s['mean']:.2f}", f"{s['median']:.2f}", f"{s[f'p{PERCENTILE}']:.2f}")
        )
        lines.append(f"{name:<30}" + "".join(f"{c:>10}" for c in cells))
    if r.failed:
        errors = sorted({q.error for q in r.requests if not q.ok})
        lines.append(f"{'failed requests':<30}{r.failed}: {'; '.join(errors)[:500]}")
    return "\n".join(lines)


SUMMARY_COLUMNS = (
    ("rate", 6),
    ("completed", 10),
    ("req/s", 9),
    ("out_tok/s", 11),
    ("ttft_ms", 9),
    ("tpot_ms", 9),
    ("itl_ms", 9),
    ("e2e_ms", 9),
)


def format_summary(results: list[RateResult]) -> str:
    """One line per rate with the medians of TTFT, TPOT, ITL and e2e, for a table in the docs."""
    lines = ["".join(f"{name:>{width}}" for name, width in SUMMARY_COLUMNS)]
    for r in results:
        cells = [
            f"{r.request_rate:g}",
            str(r.completed),
            f"{r.request_throughput:.2f}",
            f"{r.output_throughput:.1f}",
        ]
        cells += [f"{s['median']:.1f}" if s else "-" for s in r.ms.values()]
        lines.append("".join(f"{c:>{w}}" for c, (_, w) in zip(cells, SUMMARY_COLUMNS)))
    return "\n".join(lines)


async def _served_model(client: httpx.AsyncClient, spec: ServeBench) -> dict:
    response = await client.get("/v1/models")
    if response.status_code != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {response.status_code}: {response.text[:300]}")
    cards = response.json()["data"]
    if spec.model is None:
        return cards[0]
    for card in cards:
        if card["id"] == spec.model:
            return card
    raise RuntimeError(f"model {spec.model!r}: the server serves {[c['id'] for c in cards]}")


def resolve_vocab_size(spec: ServeBench, card: dict) -> int:
    """--vocab-size, else the config.json of --model-dir, else of the served model's root when
    that is a directory here (a server on this machine)."""
    if spec.vocab_size is not None:
        return spec.vocab_size
    for directory in (spec.model_dir, card.get("root")):
        if directory and (Path(directory) / "config.json").is_file():
            config = json.loads((Path(directory) / "config.json").read_text())
            vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
            if vocab:
                return int(vocab)
    raise RuntimeError("the vocabulary size is unknown: give --vocab-size or --model-dir")


async def run_serve_bench(spec: ServeBench) -> tuple[str, list[RateResult]]:
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    timeout = httpx.Timeout(spec.timeout_s, connect=CONNECT_TIMEOUT_S)
    # No pool limit: a client-side queue for connections would show up as server latency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=spec.base_url, headers=headers, timeout=timeout, limits=limits, trust_env=False
    ) as client:
        card = await _served_model(client, spec)
        model = card["id"]
        room = card.get("max_model_len")
        if room is not None and spec.prompt_len + spec.output_len > room:
            raise RuntimeError(
                f"prompt + output_len = {spec.prompt_len + spec.output_len} "
                f"tokens exceeds the server's max_model_len {room}"
            )
        vocab = resolve_vocab_size(spec, card)
        # One request first: a wrong URL, key or model fails here, with the server's message.
        # Its prompt shares no prefix with any rate's (another seed).
        check = await send(
            client, model, random_prompts(1, spec.prompt_len, vocab, spec.seed)[0], spec.output_len
        )
        if not check.ok:
            raise RuntimeError(f"the first test request failed: {check.error}")
        results = []
        for i, rate in enumerate(spec.request_rates):
            seed = spec.seed + 1 + i
            prompts = bench_prompts(spec, spec.num_prompts, vocab, seed)
            results.append(await run_rate(client, spec, model, prompts, rate, seed))
    return model, results


def to_json(spec: ServeBench, model: str, results: list[RateResult]) -> dict:
    rates = []
    for r in results:
        entry = asdict(r)
        entry["request_rate"] = "inf" if math.isinf(r.request_rate) else r.request_rate
        rates.append(entry)
    config = {
        **asdict(spec),
        "api_key": None,
        "model": model,
        "request_rates": ["inf" if math.isinf(x) else x for x in spec.request_rates],
    }
    return {"config": config, "results": rates}


def add_serve_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("serve", help="load a running server: TTFT, TPOT, ITL, throughput")
    for name in (
        "base_url",
        "model",
        "request_rates",
        "num_prompts",
        "input_len",
        "num_prefixes",
        "prefix_len",
        "output_len",
        "max_concurrency",
        "vocab_size",
        "model_dir",
        "seed",
        "api_key",
        "timeout_s",
    ):
        add_field_argument(p, ServeBench, name)
    add_json_flag(p)
    p.set_defaults(func=main_serve)


def main_serve(args: argparse.Namespace) -> int:
    if httpx is None:
        print("afdserve bench serve: needs httpx; pip install 'afdserve[bench]'", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("AFDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    spec = build(ServeBench, args, api_key=api_key)
    try:
        model, results = asyncio.run(run_serve_bench(spec))
    except (RuntimeError, httpx.HTTPError) as e:
        print(f"afdserve bench serve: {e}", file=sys.stderr)
        return 1
    concurrency = spec.max_concurrency or "unlimited"
    shared = (
        f" after one of {spec.num_prefixes} shared prefixes of {spec.prefix_len}"
        if spec.num_prefixes
        else ""
    )
    print(
        f"bench serve: {spec.base_url}, model {model!r}, {spec.num_prompts} prompts of "
        f"{spec.input_len} random tokens{shared}, {spec.output_len} output tokens each, "
        f"max concurrency {concurrency}, seed {spec.seed}"
    )
    for r in results:
        print(format_rate(r, spec.num_prompts))
    print(format_summary(results))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(spec, model, results), indent=1))
    return 0 if all(r.failed == 0 for r in results) else 1
