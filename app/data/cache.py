"""Where trustbatch keeps what it caches: converted and fetched models (app/models.py, app/convert.py), HumanEval
(app/fetch.py) and tokenized prompt sets (app/data/prepare.py). At the bottom of the application, so that every
part can find it."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$TRUSTBATCH_CACHE_DIR, else $XDG_CACHE_HOME/trustbatch, else ~/.cache/trustbatch."""
    if os.environ.get("TRUSTBATCH_CACHE_DIR"):
        return Path(os.environ["TRUSTBATCH_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trustbatch"
