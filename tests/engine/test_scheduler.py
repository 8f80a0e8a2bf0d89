from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afdserve.engine.block_manager import BlockManager
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from afdserve.engine.sequence import Sequence, SequenceStatus

VOCAB = 50
EOS = 0


def next_token(prefix: list[int]) -> int:
    """The fake model: a pure function of the whole prefix, so any lost or corrupted KV entry
    changes the output."""
    return (sum(prefix) * 7 + len(prefix) * 3 + prefix[-1]) % VOCAB


def reference(prompt: list[int], params: SamplingParams, max_model_len: int) -> tuple[list, str]:
    """Plain autoregressive decoding with the same stop rules, no scheduler involved."""
    ids = list(prompt)
    while True:
        token = next_token(ids)
        ids.append(token)
        output = ids[len(prompt) :]
        if token in params.stop_token_ids or (not params.ignore_eos and token == EOS):
            return output, "stop"
        if len(output) >= params.max_tokens or len(ids) >= max_model_len:
            return output, "length"


@dataclass
class Request:
    arrival_step: int
    request_id: str
    prompt: list[int]
    params: SamplingParams


@dataclass
class RunStats:
    steps: int = 0
    preemptions: int = 0
    mixed_steps: int = 0  # a decode and a prefill chunk in the same step
    chunked_prefills: int = 0  # prefill entries that did not reach the end of the sequence
    max_reqs: int = 0
    admission_order: list[str] = field(default_factory=list)


class FakeEngine:
    """Drives a real Scheduler and BlockManager with a fake model that keeps a paged KV cache:
    it writes (request, position, token) into the slots of the block table and samples from
    what it reads back, so a wrong block table shows up as a wrong token or a failed check."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int) -> None:
        self.config = config
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(config, self.block_manager)
        self.kv: list[tuple[str, int, int] | None] = [None] * (num_blocks * block_size)
        self.computed: dict[str, int] = {}  # shadow of num_computed_tokens
        self.stats = RunStats()
        self.add_order: list[str] = []

    def slot(self, seq: Sequence, position: int) -> int:
        size = self.block_manager.block_size
        return seq.block_table[position // size] * size + position % size

    def step(self) -> tuple[SchedulerOutput, list[Sequence]]:
        sched, config = self.scheduler, self.config
        waiting_before = list(sched.waiting)
        out = sched.schedule()
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING
            assert seq.num_computed_tokens == 0 and seq.block_table == []
            self.computed[seq.request_id] = 0
        self.stats.preemptions += len(out.preempted)

        assert out.num_tokens <= config.max_num_batched_tokens
        assert out.num_reqs <= config.max_num_seqs and sched.num_running <= config.max_num_seqs
        assert len({id(e.seq) for e in out.scheduled}) == out.num_reqs
        # Admissions are a prefix of the waiting queue, in order: nobody overtakes.
        admitted = [e.seq for e in out.scheduled if e.seq in waiting_before]
        assert admitted == waiting_before[: len(admitted)]
        assert [e.seq for e in out.scheduled[out.num_reqs - len(admitted) :]] == admitted
        # Preempted sequences go in front of everyone who waited, oldest admission first.
        assert list(sched.waiting) == out.preempted[::-1] + waiting_before[len(admitted) :]
        for seq in admitted:
            if seq.request_id not in self.stats.admission_order:
                self.stats.admission_order.append(seq.request_id)

        owned = [b for seq in sched.running for b in seq.block_table]
        assert len(owned) == len(set(owned)), "two running sequences share a block"
        size = self.block_manager.block_size
        sampled: list[int | None] = []
        for entry in out.scheduled:
            seq = entry.seq
            assert not seq.is_finished and seq.status is SequenceStatus.RUNNING
            start = seq.num_computed_tokens
            end = start + entry.num_new_tokens
            assert start == self.computed.get(seq.request_id, 0), "positions are not contiguous"
            assert len(seq.block_table) == math.ceil(end / size), "blocks beyond this step"
            assert entry.samples == (end == seq.num_tokens)
            for position in range(start, end):
                token = seq.token_ids[position]
                self.kv[self.slot(seq, position)] = (seq.request_id, position, token)
            self.computed[seq.request_id] = end
            if not entry.samples:
                self.stats.chunked_prefills += 1
                sampled.append(None)
                continue
            prefix = []
            for position in range(end):
                owner, stored_position, token = self.kv[self.slot(seq, position)]
                assert (owner, stored_position) == (seq.request_id, position), "KV overwritten"
                prefix.append(token)
            sampled.append(next_token(prefix))
        kinds = {e.num_new_tokens == 1 and e.samples for e in out.scheduled}
        self.stats.mixed_steps += kinds == {True, False}
        self.stats.max_reqs = max(self.stats.max_reqs, out.num_reqs)
        self.stats.steps += 1
        finished = sched.update(out, sampled)
        for seq in finished:
            assert seq.block_table == [] and seq.is_finished
        return out, finished

    def run(self, requests: list[Request]) -> dict[str, tuple[list[int], str]]:
        pending = sorted(requests, key=lambda r: r.arrival_step)
        results: dict[str, tuple[list[int], str]] = {}
        step = 0
        while pending or self.scheduler.has_unfinished:
            if pending and not self.scheduler.has_unfinished:
                step = max(step, pending[0].arrival_step)  # idle: jump to the next arrival
            while pending and pending[0].arrival_step <= step:
                request = pending.pop(0)
                self.add_order.append(request.request_id)
                self.scheduler.add(
                    Sequence(request.request_id, request.prompt, request.params, eos_token_id=EOS)
                )
            _, finished = self.step()
            for seq in finished:
                results[seq.request_id] = (seq.output_token_ids, seq.finish_reason)
            step += 1
            assert step < 20_000, "no progress"
        assert self.block_manager.num_free_blocks == self.block_manager.num_blocks
        return results


def make_workload(seed: int, num_requests: int, max_model_len: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_model_len // 2))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            temperature=0.0,
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=tuple(rng.sample(range(1, VOCAB), rng.choice([0, 0, 2]))),
        )
        requests.append(Request(rng.randint(0, 12), f"req{i}", prompt, params))
    return requests


def expected_results(requests: list[Request], max_model_len: int) -> dict:
    return {r.request_id: reference(r.prompt, r.params, max_model_len) for r in requests}


MAX_MODEL_LEN = 48
BLOCK_SIZE = 4
# The longest sequence computes at most MAX_MODEL_LEN - 1 positions: 12 blocks of 4.
SMALLEST_POOL = math.ceil((MAX_MODEL_LEN - 1) / BLOCK_SIZE)


@pytest.mark.parametrize("budget", [4, 16, 4096])
@pytest.mark.parametrize("num_blocks", [SMALLEST_POOL, 20, 1000])
@pytest.mark.parametrize("max_num_seqs", [3, 64])
def test_outputs_identical_under_any_budget_and_pool(
    budget: int, num_blocks: int, max_num_seqs: int
) -> None:
    requests = make_workload(seed=budget + num_blocks, num_requests=10, max_model_len=MAX_MODEL_LEN)
    config = SchedulerConfig(max_num_seqs, budget, MAX_MODEL_LEN)
    engine = FakeEngine(config, num_blocks, BLOCK_SIZE)
    assert engine.run(requests) == expected_results(requests, MAX_MODEL_LEN)
    assert engine.stats.admission_order == engine.add_order
    if num_blocks == SMALLEST_POOL and budget >= 16 and max_num_seqs > 3:
        assert engine.stats.preemptions > 0, "the tiny pool was meant to force preemption"
    if budget == 4:
        assert engine.stats.chunked_prefills > 0
    if num_blocks == 1000 and max_num_seqs == 64:
        assert engine.stats.preemptions == 0


def test_outputs_identical_without_chunked_prefill() -> None:
    requests = make_workload(seed=7, num_requests=10, max_model_len=MAX_MODEL_LEN)
    config = SchedulerConfig(64, MAX_MODEL_LEN, MAX_MODEL_LEN, chunked_prefill=False)
    engine = FakeEngine(config, SMALLEST_POOL, BLOCK_SIZE)
    assert engine.run(requests) == expected_results(requests, MAX_MODEL_LEN)
    assert engine.stats.chunked_prefills == 0
    assert engine.stats.preemptions > 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(1, 64),
    extra_blocks=st.integers(0, 30),
    block_size=st.sampled_from([1, 2, 3, 4, 8]),
    max_num_seqs=st.integers(1, 8),
    chunked=st.booleans(),
)
def test_outputs_identical_random_configs(
    seed: int, budget: int, extra_blocks: int, block_size: int, max_num_seqs: int, chunked: bool
) -> None:
    max_model_len = 32
    if not chunked:
        budget = max(budget, max_model_len)
    requests = make_workload(seed, num_requests=8, max_model_len=max_model_len)
    num_blocks = math.ceil((max_model_len - 1) / block_size) + extra_blocks
    config = SchedulerConfig(max_num_seqs, budget, max_model_len, chunked_prefill=chunked)
    engine = FakeEngine(config, num_blocks, block_size)
    assert engine.run(requests) == expected_results(requests, max_model_len)


def make_scheduler(
    budget: int = 64, num_blocks: int = 100, block_size: int = 4, **kwargs: int | bool
) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, **kwargs)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def make_seq(request_id: str, prompt_len: int, **params: object) -> Sequence:
    return Sequence(request_id, list(range(1, prompt_len + 1)), SamplingParams(**params), EOS)


def layout(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [
        (e.seq.request_id, e.seq.num_computed_tokens, e.num_new_tokens, e.samples)
        for e in out.scheduled
    ]


def sample_all(out: SchedulerOutput, token: int = 7) -> list[int | None]:
    return [token if e.samples else None for e in out.scheduled]


def test_prompt_chunked_across_steps_with_exact_positions() -> None:
    sched = make_scheduler(budget=4)
    sched.add(make_seq("a", 10, max_tokens=3))
    expected = [("a", 0, 4, False), ("a", 4, 4, False), ("a", 8, 2, True), ("a", 10, 1, True)]
    for row in expected:
        out = sched.schedule()
        assert layout(out) == [row]
        assert not out.uniform_decode or row[2] == 1
        sched.update(out, sample_all(out))
    assert sched.running[0].num_computed_tokens == 11
    assert sched.running[0].output_token_ids == [7, 7]


def test_decode_and_prefill_chunk_mixed_in_one_step() -> None:
    sched = make_scheduler(budget=8)
    sched.add(make_seq("a", 3))
    out = sched.schedule()
    assert layout(out) == [("a", 0, 3, True)]
    sched.update(out, sample_all(out))
    sched.add(make_seq("b", 20))
    out = sched.schedule()
    assert layout(out) == [("a", 3, 1, True), ("b", 0, 7, False)]
    assert out.num_tokens == 8 and out.num_reqs == 2
    assert not out.uniform_decode
    sched.update(out, sample_all(out))
    out = sched.schedule()
    assert layout(out) == [("a", 4, 1, True), ("b", 7, 7, False)]


def test_uniform_decode_flag() -> None:
    sched = make_scheduler(budget=1)
    empty = sched.schedule()
    assert empty.is_empty and not empty.uniform_decode and empty.num_tokens == 0
    sched.add(make_seq("a", 2))
    out = sched.schedule()
    assert layout(out) == [("a", 0, 1, False)]
    assert not out.uniform_decode, "a one-token prefill chunk is not a decode"
    sched.update(out, [None])
    out = sched.schedule()
    assert layout(out) == [("a", 1, 1, True)]
    assert out.uniform_decode, "a one-token chunk that reaches the end samples like a decode"
    sched.update(out, [5])
    out = sched.schedule()
    assert out.uniform_decode
    # The flag is fixed at schedule time and survives update().
    sched.update(out, [5])
    assert out.uniform_decode and out.scheduled[0].samples


def test_max_num_seqs_and_fifo_admission() -> None:
    sched = make_scheduler(budget=1000, max_num_seqs=2)
    for name in "abcde":
        sched.add(make_seq(name, 5))
    out = sched.schedule()
    assert [e.seq.request_id for e in out.scheduled] == ["a", "b"]
    assert sched.num_running == 2 and sched.num_waiting == 3
    sched.update(out, sample_all(out))
    assert sched.abort("a") is not None
    out = sched.schedule()
    assert [e.seq.request_id for e in out.scheduled] == ["b", "c"]


def test_waiting_request_never_overtakes_one_that_does_not_fit() -> None:
    sched = make_scheduler(budget=64, num_blocks=4, block_size=4)
    sched.add(make_seq("c", 8))
    out = sched.schedule()
    sched.update(out, sample_all(out))
    sched.add(make_seq("a", 13))  # needs 4 blocks, only 1 free after c's decode
    sched.add(make_seq("b", 2))  # would fit in that 1 block, but arrived after a
    out = sched.schedule()
    assert layout(out) == [("c", 8, 1, True)]
    assert [seq.request_id for seq in sched.waiting] == ["a", "b"]


def test_preemption_victim_is_most_recent_and_recomputes() -> None:
    sched = make_scheduler(budget=64, num_blocks=2, block_size=2)
    a, b = make_seq("a", 2), make_seq("b", 2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert layout(out) == [("a", 0, 2, True), ("b", 0, 2, True)]
    sched.update(out, [11, 12])
    out = sched.schedule()  # a needs a 2nd block; b, admitted last, gives its block up
    assert layout(out) == [("a", 2, 1, True)]
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and b.token_ids == [1, 2, 12] and b.num_prompt_tokens == 2
    assert list(sched.waiting) == [b]
    sched.update(out, [13])
    sched.finish(a, "stop")
    out = sched.schedule()  # b recomputes its prompt and its generated token, then samples
    assert layout(out) == [("b", 0, 3, True)]
    sched.update(out, [14])
    assert b.output_token_ids == [12, 14]


def test_running_request_preempts_itself_when_it_is_the_newest() -> None:
    sched = make_scheduler(budget=64, num_blocks=2, block_size=2)
    a, b = make_seq("a", 1), make_seq("b", 2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, sample_all(out))  # a: 2 tokens in 1 block; b: 3 tokens, 1 block, pool full
    out = sched.schedule()  # a's decode fits its block; b needs a 2nd one and is the newest
    assert layout(out) == [("a", 1, 1, True)]
    assert out.preempted == [b] and list(sched.waiting) == [b]
    assert sched.block_manager.num_free_blocks == 1


def test_kv_cache_too_small_for_one_request() -> None:
    sched = make_scheduler(budget=64, num_blocks=2, block_size=2, max_model_len=100)
    sched.add(make_seq("a", 3, max_tokens=10))
    for _ in range(2):
        out = sched.schedule()
        sched.update(out, sample_all(out))
    with pytest.raises(RuntimeError, match="KV cache too small.*'a'.*2 blocks of 2 tokens"):
        sched.schedule()

    sched = make_scheduler(budget=512, num_blocks=2, block_size=2, chunked_prefill=False)
    sched.add(make_seq("b", 5))
    with pytest.raises(RuntimeError, match="KV cache too small"):
        sched.schedule()


def test_abort_frees_blocks_from_running_and_waiting() -> None:
    sched = make_scheduler(budget=64, num_blocks=10, block_size=4, max_num_seqs=1)
    a, b = make_seq("a", 9), make_seq("b", 4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert sched.block_manager.num_free_blocks == 7
    sched.update(out, sample_all(out))
    assert sched.abort("a") is a
    assert a.finish_reason == "abort" and a.is_finished and a.block_table == []
    assert sched.block_manager.num_free_blocks == 10
    assert sched.abort("b") is b and b.finish_reason == "abort"
    assert sched.abort("b") is None and sched.abort("nope") is None
    assert not sched.has_unfinished and sched.schedule().is_empty


def test_abort_while_step_in_flight() -> None:
    sched = make_scheduler(budget=64)
    a, b = make_seq("a", 3), make_seq("b", 3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort("a")
    assert sched.update(out, [5, 6]) == []
    assert a.token_ids == [1, 2, 3] and b.token_ids == [1, 2, 3, 6]
    assert layout(sched.schedule()) == [("b", 3, 1, True)]


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "num_outputs"),
    [
        ({"max_tokens": 10}, [5, 5, EOS, 5], "stop", 3),
        ({"max_tokens": 4, "ignore_eos": True}, [EOS, EOS, EOS, EOS], "length", 4),
        ({"max_tokens": 10, "stop_token_ids": (9,)}, [5, 9], "stop", 2),
        ({"max_tokens": 10, "stop_token_ids": [9], "ignore_eos": True}, [EOS, 9], "stop", 2),
        ({"max_tokens": 3}, [5, 5, 5, 5], "length", 3),
        ({"max_tokens": 100}, [5] * 20, "length", 16 - 6),  # max_model_len=16, prompt of 6
    ],
)
def test_finish_reasons(params: dict, tokens: list[int], reason: str, num_outputs: int) -> None:
    sched = make_scheduler(budget=64, num_blocks=8, block_size=2, max_model_len=16)
    seq = make_seq("a", 6, **params)
    sched.add(seq)
    for token in tokens:
        out = sched.schedule()
        finished = sched.update(out, [token])
        if finished:
            break
    assert finished == [seq]
    assert seq.finish_reason == reason and seq.num_output_tokens == num_outputs
    assert seq.block_table == [] and sched.block_manager.num_free_blocks == 8
    assert not sched.has_unfinished


def test_finish_early_for_stop_string() -> None:
    sched = make_scheduler()
    a, b = make_seq("a", 3), make_seq("b", 3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, sample_all(out))
    sched.finish(a, "stop")
    assert a.finish_reason == "stop" and a.block_table == [] and sched.num_running == 1
    sched.finish(a, "stop")  # already finished: nothing happens
    assert layout(sched.schedule()) == [("b", 3, 1, True)]
    with pytest.raises(ValueError, match="reason"):
        sched.finish(b, "done")


def test_add_and_update_validation() -> None:
    sched = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len=8"):
        sched.add(make_seq("long", 8))
    sched.add(make_seq("a", 7))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(make_seq("a", 2))
    out = sched.schedule()
    with pytest.raises(ValueError, match="sampled entries"):
        sched.update(out, [])
    with pytest.raises(ValueError, match="samples=True"):
        sched.update(out, [None])
    finished = sched.update(out, [3])  # 8 tokens == max_model_len
    assert finished[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_num_seqs": 2.5}, "max_num_seqs"),
        ({"chunked_prefill": 1}, "chunked_prefill"),
        ({"chunked_prefill": False, "max_num_batched_tokens": 100}, "max_num_batched_tokens"),
    ],
)
def test_config_validation(kwargs: dict, field_name: str) -> None:
    with pytest.raises(ValueError, match=f"SchedulerConfig.{field_name}="):
        SchedulerConfig(**kwargs)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=30),
    st.integers(4, 32),
    st.integers(1, 8),
    st.integers(1, 6),
)
def test_budget_filled_with_prefill_chunks_beside_decodes(
    prompt_lens: list[int], budget: int, max_num_seqs: int, max_tokens: int
) -> None:
    """Hundreds of requests at once, as a server at saturation sees them: a step leaves token
    budget unused only when nothing could take it (no waiting prompt, or max_num_seqs
    running), and a step that decodes also carries the prefill chunks that fit beside it."""
    sched = make_scheduler(budget=budget, num_blocks=1000, max_num_seqs=max_num_seqs)
    for i, n in enumerate(prompt_lens):
        sched.add(make_seq(f"r{i}", n, max_tokens=max_tokens, ignore_eos=True))
    while sched.has_unfinished:
        before = {seq.request_id for seq in sched.running}
        out = sched.schedule()
        assert out.num_tokens <= budget
        if sched.waiting and len(sched.running) < max_num_seqs:
            assert out.num_tokens == budget, f"budget {budget} left unused: {layout(out)}"
        decodes = any(e.seq.request_id in before for e in out.scheduled)
        if decodes and len(before) < max_num_seqs and sched.waiting:
            assert any(e.seq.request_id not in before for e in out.scheduled) or (
                out.num_tokens == budget
            ), f"decodes ran alone while prompts waited: {layout(out)}"
        sched.update(out, sample_all(out))
