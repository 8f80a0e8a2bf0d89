"""Models by hub id, offline, from a Hugging Face cache laid out on disk as huggingface_hub lays it
(models--org--name/{blobs,refs/main,snapshots/<commit>}): huggingface_hub's own
try_to_load_from_cache must find the files (so the layout is the real one), and the LLM loaded by
hub id must give the tokens of the same checkpoint loaded from its directory."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants, try_to_load_from_cache
from huggingface_hub.utils import filter_repo_objects

from afdserve.model.checkpoint.hub import ALLOW_PATTERNS, REMOTE_CODE_PATTERNS, resolve_model_dir
from afdserve.model.fixtures.bundled import bundled_model_dir

REPO = "afdserve-test/tiny-moe"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(
    cache: Path, repo: str, source: Path, commit: str = COMMIT, ref: str | None = "main"
) -> Path:
    """`source`'s files as huggingface_hub's cache holds a snapshot: each file's bytes once under
    blobs/<hash>, snapshots/<commit>/<name> a relative symlink to its blob, refs/<ref> the
    commit. Returns the snapshot directory."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    blobs, snapshot = storage / "blobs", storage / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    if ref is not None:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: this process's copy, and the
    # variable for any subprocess.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_layout_is_huggingface_hubs_own(tmp_path: Path) -> None:
    snapshot = lay_out_cache(tmp_path, REPO, bundled_model_dir())
    found = try_to_load_from_cache(REPO, "config.json", cache_dir=tmp_path)
    assert found == str(snapshot / "config.json")
    assert Path(found).read_bytes() == (bundled_model_dir() / "config.json").read_bytes()


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(tmp_path: Path, offline) -> None:
    snapshot = lay_out_cache(tmp_path, REPO, bundled_model_dir())
    assert resolve_model_dir(REPO, download_dir=str(tmp_path)) == str(snapshot)
    # A commit is a revision too; a branch the cache has no ref for is not there.
    assert resolve_model_dir(REPO, revision=COMMIT, download_dir=str(tmp_path)) == str(snapshot)
    with pytest.raises(ValueError) as error:
        resolve_model_dir(REPO, revision="v2", download_dir=str(tmp_path))
    assert f"model={REPO!r} (revision 'v2'): not in the Hugging Face cache" in str(error.value)
    assert "HF_HUB_OFFLINE is set" in str(error.value)
    assert f"hf download {REPO} --revision v2 --cache-dir {tmp_path}" in str(error.value)


def test_not_cached_offline_names_the_command_that_fetches_it(tmp_path: Path, offline) -> None:
    with pytest.raises(ValueError) as error:
        resolve_model_dir("Qwen/Qwen3-30B-A3B", download_dir=str(tmp_path))
    message = str(error.value)
    assert message.startswith("model='Qwen/Qwen3-30B-A3B': not in the Hugging Face cache")
    assert "`hf download Qwen/Qwen3-30B-A3B --cache-dir" in message and "\n" not in message


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("/no/such/model", "model='/no/such/model': no such directory"),
        ("./relative/dir", "model='./relative/dir': no such directory"),
    ],
)
def test_a_missing_path_is_not_taken_for_a_hub_id(model: str, message: str, offline) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_model_dir(model)


def test_revision_of_a_local_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="revision='v1': applies to a hub id"):
        resolve_model_dir(str(bundled_model_dir()), revision="v1")


def test_only_what_afdserve_reads_is_downloaded() -> None:
    """huggingface_hub's own pattern filter over a repository as published (Qwen3's files plus
    the pickles, GGUF and code some repositories carry)."""
    listing = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "tokenizer.model",
        "chat_template.jinja",
        "pytorch_model.bin",
        "consolidated.pt",
        "model-q4.gguf",
        "modeling_custom.py",
        "tokenization_custom.py",
        "README.md",
        "original/consolidated.00.pth",
    ]
    fetched = set(filter_repo_objects(listing, allow_patterns=list(ALLOW_PATTERNS)))
    assert fetched == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "tokenizer.model",
        "chat_template.jinja",
    }
    with_code = set(
        filter_repo_objects(listing, allow_patterns=[*ALLOW_PATTERNS, *REMOTE_CODE_PATTERNS])
    )
    assert with_code - fetched == {"tokenization_custom.py"}  # never modeling code


def test_llm_by_hub_id_gives_the_tokens_of_its_directory(tmp_path: Path, offline) -> None:
    from afdserve import LLM, SamplingParams

    lay_out_cache(tmp_path, REPO, bundled_model_dir())
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = ["Hello, my name is", "The sky"]
    with LLM(str(bundled_model_dir()), device="cpu") as local:
        want = [o.outputs[0].token_ids for o in local.generate(prompts, params, use_tqdm=False)]
    with LLM(REPO, download_dir=str(tmp_path), tokenizer=REPO) as hub:
        assert hub.model_name == REPO  # served under the id, as vLLM does
        got = [o.outputs[0].token_ids for o in hub.generate(prompts, params, use_tqdm=False)]
        assert hub.engine_config.model.startswith(str(tmp_path))
        assert hub.engine_config.device == "cpu"  # auto, on this CPU-only machine
    assert got == want


def test_the_cli_honours_hf_home_and_hf_hub_offline(tmp_path: Path) -> None:
    """`afdserve generate ORG/NAME` with the cache found through $HF_HOME (no --download-dir) and
    the hub switched off through the environment alone."""
    lay_out_cache(tmp_path / "hub", REPO, bundled_model_dir())
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "afdserve.cli",
        "generate",
        "--prompt",
        "Hi",
        "--json",
        "--max-tokens",
        "4",
    ]
    by_id = subprocess.run([*command, REPO], capture_output=True, text=True, env=env, timeout=120)
    assert by_id.returncode == 0, by_id.stderr
    by_dir = subprocess.run(
        [*command, str(bundled_model_dir())], capture_output=True, text=True, env=env, timeout=120
    )
    assert by_dir.returncode == 0, by_dir.stderr
    assert by_id.stdout == by_dir.stdout and '"token_ids": [' in by_id.stdout
    missing = subprocess.run(
        [*command, "org/absent"], capture_output=True, text=True, env=env, timeout=120
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"afdserve: error: model='org/absent': not in the Hugging Face cache {tmp_path / 'hub'}, "
        "and HF_HUB_OFFLINE is set; fetch it first with `hf download org/absent --include "
        + " ".join(f"'{p}'" for p in ALLOW_PATTERNS)
        + "`"
    ]
