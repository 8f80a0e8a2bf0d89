"""A model named by its Hugging Face hub id (`Qwen/Qwen3-30B-A3B`), read through huggingface_hub's
cache as vLLM reads it: a local directory is used as it is; anything else that reads as a repo id is
a snapshot of the hub's repository, downloaded once into the cache (`download_dir`, else
$HF_HUB_CACHE, else $HF_HOME/hub) and found there afterwards, also with HF_HUB_OFFLINE=1.

Only what afdserve reads is fetched (ALLOW_PATTERNS): the config and generation config, the
tokenizer's files, the safetensors shards and their index; never `.bin`/`.pt` pickles (afdserve
loads safetensors alone) and no Python code unless `trust_remote_code` (then a tokenizer's own
tokenization_*.py, for transformers). HF_TOKEN (or a saved `hf auth login` token) is honoured by
huggingface_hub itself.

Every failure is one ValueError naming the model, what is wrong and what to do, before any process
starts.
"""

from __future__ import annotations

import re
from pathlib import Path

from afdserve.model.fixtures.bundled import resolve_model

# What afdserve reads from a model repository (engine/tokenizer.py, model/config.py, loader.py,
# frontend/generation_config.py).
ALLOW_PATTERNS = (
    "*.json",  # config, generation_config, tokenizer(_config), vocab, the safetensors index
    "*.safetensors",
    "tokenizer*",  # tokenizer.model (sentencepiece) and the rest of a tokenizer's own files
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",  # chat_template.jinja
)
TOKENIZER_PATTERNS = ("*.json", "tokenizer*", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja")
REMOTE_CODE_PATTERNS = ("tokenization*.py",)  # only with trust_remote_code
# huggingface_hub's repo ids: a name, or namespace/name, of letters, digits, '-', '_' and '.'.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


def looks_like_repo_id(name: str) -> bool:
    return _REPO_ID.fullmatch(name) is not None and ".." not in name and not name.endswith(".")


def fetch_command(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    """The command that puts `repo_id` into the cache this process reads."""
    parts = ["hf", "download", repo_id]
    if revision:
        parts += ["--revision", revision]
    if download_dir:
        parts += ["--cache-dir", download_dir]
    parts += ["--include", *(f"'{p}'" for p in ALLOW_PATTERNS)]
    return " ".join(parts)


def resolve_model_dir(
    model: str | None,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    trust_remote_code: bool = False,
    what: str = "model",
    patterns: tuple[str, ...] = ALLOW_PATTERNS,
) -> str:
    """The local directory of `model`: the bundled tiny model (None, "", "tiny"), a directory as
    given, or the cached snapshot of a hub id (downloaded first unless HF_HUB_OFFLINE)."""
    if model in (None, "", "tiny"):
        if revision is not None:
            raise ValueError(
                f"revision={revision!r}: applies to a hub id, and {what} is the bundled tiny model"
            )
        return resolve_model(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(
                f"revision={revision!r}: applies to a hub id, and {what}={model!r} "
                "is a local directory"
            )
        return str(path)
    if not looks_like_repo_id(model):
        raise ValueError(
            f"{what}={model!r}: no such directory (expected a Hugging Face model "
            "directory or a hub id such as Qwen/Qwen3-30B-A3B)"
        )
    if trust_remote_code:
        patterns = (*patterns, *REMOTE_CODE_PATTERNS)
    return _snapshot(model, revision, download_dir, what, patterns)


def _snapshot(
    repo_id: str,
    revision: str | None,
    download_dir: str | None,
    what: str,
    patterns: tuple[str, ...],
) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    named = f"{what}={repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    cache = download_dir or constants.HF_HUB_CACHE
    fetch = fetch_command(repo_id, revision, download_dir)
    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=list(patterns),
            local_files_only=offline,
        )
    except GatedRepoError:
        raise ValueError(
            f"{named}: a gated repository; accept its terms on the hub, then set "
            "HF_TOKEN (or run `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{named}: no such directory, and no such repository on the hub (a "
            "private one needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(
            f"{named}: the repository has no such revision (a branch, tag or commit)"
        ) from None
    except IncompleteSnapshotError as e:
        raise ValueError(
            f"{named}: the cached snapshot in {cache} is incomplete and the hub "
            f"cannot be reached; complete it with `{fetch}` ({e})"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ValueError(
            f"{named}: not in the Hugging Face cache {cache}, and {why}; fetch it "
            f"first with `{fetch}`"
        ) from None
    except HFValidationError as e:
        raise ValueError(f"{named}: no such directory, and not a hub id ({e})") from None
