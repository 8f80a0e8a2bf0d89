"""The bundled tiny model: built on first use into the user's cache, so a fresh install can run
`afdserve generate` / `afdserve serve` with no download."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

BUNDLED_FAMILY = "qwen3_moe"
BUNDLED_NAME = f"afdserve-tiny-{BUNDLED_FAMILY}-v1"


def cache_root() -> Path:
    root = os.environ.get("AFDSERVE_CACHE") or os.path.join(Path.home(), ".cache", "afdserve")
    return Path(root)


def bundled_model_dir() -> Path:
    """Path of the bundled tiny model, created atomically if it does not exist yet."""
    from afdserve.model.tiny import make_tiny_model

    target = cache_root() / BUNDLED_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        make_tiny_model(tmp, BUNDLED_FAMILY, hash_layers=1, seed=0)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str | None) -> str:
    return str(bundled_model_dir()) if model in (None, "", "tiny") else str(model)
