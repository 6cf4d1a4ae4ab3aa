"""Load a Hugging Face causal LM, or build the tiny offline model and tokenizer the quickstart trains.

The tiny tokenizer is byte-level with no merges: each of the 256 bytes is one token, written with GPT-2's
bytes-to-unicode symbols (space -> 'Ġ', newline -> 'Ċ'), behind Qwen2's normalizer, pre-tokenizer and decoder.
That exact shape matters: a directory whose config.json says `model_type: qwen2` is always re-loaded by
transformers 5 `AutoTokenizer` as `Qwen2Tokenizer` (BPE + byte-level pre-tokenizer), ignoring `tokenizer_class`,
and so does every server that loads the directory that way (SGLang). A byte-level vocabulary tokenizes
identically through both paths; a plain character vocabulary would silently lose spaces and newlines.

Lossless: `decode(encode(text)) == unicodedata.normalize("NFC", text)` for any text (Qwen2's NFC normalizer is
kept on purpose, so ids match what a real Qwen2 tokenizer pipeline would do; NFC text round-trips exactly).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # importing transformers takes ~10 s here: only the functions that need it pay for it
    from transformers import (
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
        Qwen2ForCausalLM,
    )

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

# Qwen2's pre-tokenizer split regex (transformers/models/qwen2/tokenization_qwen2.py: PRETOKENIZE_REGEX).
QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# ChatML as Qwen2 renders it, without Qwen2's injected default system message (the tiny model has never seen one).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode symbol map (the alphabet of every byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The offline byte-level tokenizer: ids 0-255 are the bytes in order, then the three special tokens (259 in all).

    `<|endoftext|>` (id 256) is both eos and pad; `<|im_start|>` / `<|im_end|>` delimit ChatML
    turns. Saved with `save_model`, it re-loads through `AutoTokenizer` (as Qwen2Tokenizer) with identical ids.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: byte for byte, symbol in _bytes_to_unicode().items()}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        bos_token=None,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


@dataclass
class TinyModelConfig:
    """Shape of the tiny Qwen2 model built offline for the quickstart and the tests (about 1M parameters)."""

    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 512
    """Width of the SwiGLU MLP."""
    num_layers: int = 4
    """Number of decoder layers."""
    num_heads: int = 4
    """Attention (query) heads; must divide hidden_size."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    max_position_embeddings: int = 256
    """Longest sequence (prompt + completion) in tokens."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the output projection (halves the embedding parameters)."""
    seed: int = 0
    """Seed of the weight initialisation: the same config always gives the same weights."""

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"model.tiny.{name}={value} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.tiny.hidden_size={self.hidden_size} is not divisible by model.tiny.num_heads="
                f"{self.num_heads}; pick num_heads among the divisors of hidden_size"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.tiny.num_heads={self.num_heads} is not divisible by model.tiny.num_kv_heads="
                f"{self.num_kv_heads}; pick num_kv_heads among the divisors of num_heads"
            )


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> Qwen2ForCausalLM:
    """A freshly initialised float32 Qwen2ForCausalLM sized by `cfg`, with the vocabulary of `tokenizer`.

    Initialisation uses a private generator state (`torch.random.fork_rng`), so the same config gives the same
    weights and the caller's global RNG is left untouched. SDPA attention: on CPU, one thread, with the default
    config it was 5-10% faster than eager for both training (32 x 48 tokens, left-padded, forward+backward) and
    sampling (64 prompts x 8 new tokens), and its logits matched eager to 4e-7.
    """
    from transformers import AutoModelForCausalLM, Qwen2Config

    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.generation_config.pad_token_id = pad_id
    return model.eval()


def _looks_like_path(path_or_id: str) -> bool:
    # A hub id is "name" or "org/name"; anything absolute, relative-dotted, home-relative or deeper is a path.
    return (
        path_or_id.startswith(("/", ".", "~"))
        or path_or_id.count("/") > 1
        or os.sep != "/"
        and os.sep in path_or_id
    )


def load_model(
    path_or_id: str, *, dtype: str = "float32", device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local HF directory (or a hub id where a hub is reachable).

    `dtype` is one of float32 | bfloat16 | float16. The tokenizer always has a pad token (falls back to eos).
    Nothing here relies on `model.generation_config`: callers pass sampling arguments explicitly.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    local = Path(path_or_id).expanduser()
    from_hub = not local.is_dir()
    if not from_hub:
        source = str(local)
        if not (local / "config.json").is_file() and (local / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"model directory {path_or_id!r} is a LoRA adapter (adapter_config.json, no config.json), not a "
                "model: give the checkpoint's model/ directory beside it (the merged weights), or the base model "
                "with trainer.lora.rank set to train new adapters"
            )
        if not (local / "config.json").is_file():
            raise FileNotFoundError(
                f"model directory {path_or_id!r} has no config.json; point at a directory written by "
                f"save_pretrained (config.json + *.safetensors + tokenizer files)"
            )
    elif local.exists() or _looks_like_path(path_or_id):
        raise FileNotFoundError(
            f"model path {path_or_id!r}: no local directory there; give a directory written by save_pretrained "
            f"(config.json + *.safetensors + tokenizer files) or a hub id such as 'Qwen/Qwen2.5-0.5B'"
        )
    else:
        source = path_or_id
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=_DTYPES[dtype])
    except (
        OSError,
        ValueError,
    ) as err:  # huggingface_hub raises HFValidationError (a ValueError) for bad ids
        if from_hub:
            offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
            raise OSError(
                f"cannot load model {path_or_id!r}: no local directory and the hub is unreachable/offline"
                f"{' (HF_HUB_OFFLINE is set)' if offline else ''} or has no such repository; download it on a "
                f"machine with hub access (`hf download {path_or_id} --local-dir DIR`) and pass DIR. Cause: {err}"
            ) from err
        raise ValueError(f"cannot load model from directory {source!r}: {err}") from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer of {path_or_id!r} has neither a pad nor an eos token; add one and re-save"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike) -> None:
    """Write model (safetensors) and tokenizer to `path`, loadable back by transformers / SGLang / `load_model`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    *,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of a plain prompt (no special tokens added) or of a chat rendered with the generation prompt (and
    the tool schemas ``tools``, for a template that shows tools to the model)."""
    if (prompt is None) == (messages is None):
        raise ValueError("encode_prompt needs exactly one of prompt= or messages=")
    if prompt is not None:
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not tokenizer.chat_template:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template, so chat `messages` rows cannot be "
            f"rendered; use plain `prompt` rows, or a model whose tokenizer_config.json / chat_template.jinja has one"
        )
    extra = {"tools": tools} if tools else {}
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    ids = (
        encoded["input_ids"] if not isinstance(encoded, list) else encoded
    )  # transformers 5: a BatchEncoding
    return list(ids)
