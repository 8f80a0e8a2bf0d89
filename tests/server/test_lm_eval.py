"""lm-eval-harness's `local-completions` model against a live server (a real uvicorn process)
on a multiple-choice loglikelihood task read from a local file. The oracle: the offline API's
prompt logprobs on the same token ids (themselves held to transformers' logits in
tests/engine/test_prompt_logprobs.py), per choice, and the accuracy that follows from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.bundled import bundled_model_dir

from .conftest import SERVED_NAME, free_port, start_server

lm_eval = pytest.importorskip("lm_eval")

DOCS = [
    {"context": "The cat sat on the", "choices": [" mat", " moon", " xq"], "label": 0},
    {"context": "One, two,", "choices": [" three", " blue"], "label": 0},
    {"context": "Hello, wor", "choices": ["ld", "st", "m"], "label": 0},
    {"context": "abc", "choices": ["d", "z"], "label": 1},
]
TASK = """task: afdserve_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""


def offline_loglikelihood(llm: LLM, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of the continuation's logprobs given the context, and whether each was the argmax."""
    ctx = llm.tokenizer.encode(context, add_special_tokens=False)
    cont = llm.tokenizer.encode(continuation, add_special_tokens=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    (out,) = llm.generate([{"prompt_token_ids": ctx + cont}], params, use_tqdm=False)
    entries = out.prompt_logprobs[len(ctx) :]
    total = sum(e[t].logprob for e, t in zip(entries, cont, strict=True))
    return total, all(e[t].rank == 1 for e, t in zip(entries, cont, strict=True))


def test_lm_eval_local_completions_loglikelihood(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    server = start_server(tmp_path, free_port(), topology="colocated")
    try:
        server.wait_healthy()
        model_args = {
            "base_url": f"{server.url}/v1/completions",
            "model": SERVED_NAME,
            "tokenizer": str(bundled_model_dir()),
            "tokenizer_backend": "huggingface",
            "num_concurrent": 1,
            "max_retries": 1,
        }
        results = simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=["afdserve_local_mc"],
            task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True,
        )
    finally:
        server.stop()

    samples = sorted(results["samples"]["afdserve_local_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    correct = 0
    with LLM() as llm:
        for sample, doc in zip(samples, DOCS, strict=True):
            want = [offline_loglikelihood(llm, doc["context"], c) for c in doc["choices"]]
            got = [resp[0] for resp in sample["resps"]]  # [(loglikelihood, is_greedy)] each
            for (got_ll, got_greedy), (want_ll, want_greedy) in zip(got, want, strict=True):
                assert abs(float(got_ll) - want_ll) < 1e-4 and bool(got_greedy) == want_greedy
            best = max(range(len(want)), key=lambda i: want[i][0])
            correct += best == doc["label"]
    accuracy = results["results"]["afdserve_local_mc"]["acc,none"]
    assert accuracy == pytest.approx(correct / len(DOCS))
