"""`trustbatch convert-gguf`: its refusals (fast, no model), then the real SmolLM2-135M-Instruct GGUF.

The real-model tests take the GGUF file that `make smollm2` keeps in the trustbatch cache; without it they skip
with that command, and under CI=true they fail (CI builds the cache first). One conversion per module, run as a
user runs it, on one thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import remove_unless_failed

from .conftest import REPO


def trustbatch(*args: str, python_prelude: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if python_prelude is None:
        cmd = [sys.executable, "-m", "app.cli", *args]
    else:
        launcher = f"{python_prelude}\nimport sys\nsys.argv = ['trustbatch', *sys.argv[1:]]\nfrom app.cli import main\nmain()"
        cmd = [sys.executable, "-c", launcher, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def assert_one_line_error(out: subprocess.CompletedProcess, fragment: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    # Progress lines may come first; the error is one line, the last, with no traceback.
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], out.stderr
    assert "Traceback" not in out.stderr
    assert fragment in lines[-1], out.stderr


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


# ------------------------------------------------------------------------------------------ refusals


def test_missing_file(tmp_path):
    out = trustbatch("convert-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "out"))
    assert_one_line_error(out, "nope.gguf: no such file")
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_text('{"this": "is json"}')
    out = trustbatch("convert-gguf", str(bogus), str(tmp_path / "out"))
    assert_one_line_error(out, "model.gguf: not a GGUF file")


def test_gguf_package_not_installed(tmp_path):
    looks_right = tmp_path / "model.gguf"
    looks_right.write_bytes(b"GGUF" + bytes(60))
    # The package made unimportable in the child process, as on an install without the extra.
    out = trustbatch(
        "convert-gguf",
        str(looks_right),
        str(tmp_path / "out"),
        python_prelude="import sys\nsys.modules['gguf'] = None",
    )
    assert_one_line_error(out, "pip install 'trustbatch[gguf]'")
    assert "make setup" in out.stderr


@pytest.mark.parametrize("kind", ["non-empty directory", "file"])
def test_out_dir_taken(tmp_path, kind):
    looks_right = tmp_path / "model.gguf"
    looks_right.write_bytes(b"GGUF" + bytes(60))
    taken = tmp_path / "out"
    if kind == "file":
        taken.write_text("x")
        fragment = "exists and is not a directory"
    else:
        taken.mkdir()
        (taken / "keep.txt").write_text("mine")
        fragment = "exists and is not empty; choose another directory or pass --force"
    out = trustbatch("convert-gguf", str(looks_right), str(taken))
    assert_one_line_error(out, fragment)
    if kind != "file":
        assert (taken / "keep.txt").read_text() == "mine"


def test_unreadable_gguf_leaves_nothing_behind(tmp_path):
    """A file with the magic but no valid content: a one-line error from the reader, no partial directory."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + os.urandom(256))
    out = trustbatch("convert-gguf", str(broken), str(tmp_path / "out"))
    assert_one_line_error(out, "broken.gguf: transformers cannot read its")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path, "out") == []


# ----------------------------------------------------------------------------- the real SmolLM2 GGUF

PROBES = [
    "Hello, world! How are you today?",
    "0 1 22 333 4444 55555 3.14159 -17 1e10 2+2=4",
    "Ünïcödé: naïve café, 北京, Москва, 🚀✨, e\u0301, \u200bzero-width",
    "def f(x):\n    return x ** 2\n\n\n",
]
CHAT = [
    {"role": "user", "content": "What is 12*12?"},
    {"role": "assistant", "content": "144"},
    {"role": "user", "content": "And 13*13? Answer with a number only."},
]


@pytest.fixture(scope="module")
def converted(smollm2_gguf, tmp_path_factory, request):
    """The GGUF converted by `trustbatch convert-gguf --force` over a stale, non-empty directory."""
    out_dir = tmp_path_factory.mktemp("convert") / "smollm2"
    request.addfinalizer(lambda: remove_unless_failed(request, out_dir.parent))
    out_dir.mkdir()
    (out_dir / "stale.bin").write_bytes(b"old")
    done = trustbatch("convert-gguf", str(smollm2_gguf), str(out_dir), "--force")
    assert done.returncode == 0, done.stderr[-3000:]
    return out_dir, done


@pytest.fixture(scope="module")
def from_gguf(smollm2_gguf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).eval()
    return tokenizer, model


def test_conversion_writes_a_complete_directory(converted):
    out_dir, done = converted
    assert done.stdout.strip() == f"wrote {out_dir}"
    for phase in (
        "reading the tokenizer",
        "dequantizing the weights",
        "as safetensors",
        "verifying",
        "verified",
    ):
        assert phase in done.stderr
    names = {p.name for p in out_dir.iterdir()}
    assert "stale.bin" not in names  # --force replaced the directory, it did not merge into it
    assert {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "gguf_conversion.json",
    } <= names
    assert leftovers(out_dir.parent, out_dir.name) == []
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152
    assert "quantization_config" not in config
    record = json.loads((out_dir / "gguf_conversion.json").read_text())
    assert record["architecture"] == "LlamaForCausalLM" and record["chat_template"] is True


def test_reloaded_tokenizer_matches_the_gguf_one(converted, from_gguf):
    from transformers import AutoTokenizer

    gguf_tokenizer, _ = from_gguf
    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    assert len(tokenizer) == len(gguf_tokenizer) == 49152
    for text in PROBES:
        assert tokenizer(text)["input_ids"] == gguf_tokenizer(text)["input_ids"], text
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == gguf_tokenizer.decode(
            gguf_tokenizer(text)["input_ids"]
        )
    assert tokenizer.chat_template is not None
    assert tokenizer.chat_template == gguf_tokenizer.chat_template
    for generation_prompt in (False, True):
        text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=generation_prompt)
        assert text == gguf_tokenizer.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert "<|im_start|>user\nWhat is 12*12?<|im_end|>" in text
        ids = tokenizer.apply_chat_template(
            CHAT, tokenize=True, add_generation_prompt=generation_prompt, return_dict=True
        )
        want = gguf_tokenizer.apply_chat_template(
            CHAT, tokenize=True, add_generation_prompt=generation_prompt, return_dict=True
        )
        assert ids["input_ids"] == want["input_ids"]
    assert (tokenizer.bos_token, tokenizer.eos_token) == (gguf_tokenizer.bos_token, gguf_tokenizer.eos_token)


def test_greedy_generation_from_the_directory_equals_the_gguf_model(converted, from_gguf):
    import torch
    from transformers import AutoModelForCausalLM

    gguf_tokenizer, gguf_model = from_gguf
    model = AutoModelForCausalLM.from_pretrained(converted[0]).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    assert model.dtype == gguf_model.dtype
    prompt = gguf_tokenizer.apply_chat_template(
        CHAT[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        want = gguf_model.generate(**prompt, max_new_tokens=8, do_sample=False)
        got = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert got.tolist() == want.tolist()
    assert got.shape[1] > prompt["input_ids"].shape[1]


def test_cached_model_is_the_same_conversion(converted, smollm2_dir):
    """The directory `make smollm2` left in the cache (the `smollm2_dir` fixture) matches this conversion."""
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert json.loads((smollm2_dir / name).read_text()) == json.loads(
            (converted[0] / name).read_text()
        ), name


def test_fetch_smollm2_reuses_the_cached_model(smollm2_dir):
    done = trustbatch("fetch-smollm2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(smollm2_dir)
    assert "already in the cache" in done.stderr
