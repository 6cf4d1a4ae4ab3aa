"""The tiny offline tokenizer and model: byte-level round trips through AutoTokenizer, save/load, chat template."""

import random
import unicodedata

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer, Qwen2ForCausalLM, Qwen2Tokenizer

from trainer.model import (
    EOS_TOKEN,
    IM_END,
    IM_START,
    TinyModelConfig,
    build_tiny_model,
    build_tiny_tokenizer,
    encode_prompt,
    load_model,
    save_model,
)

TEXTS = [
    "7+5*3-4=",
    "hello world",
    "  two leading spaces",
    " one leading space",
    "trailing spaces   ",
    "line one\nline two\n\n\nthree blank\r\nwindows\ttab",
    "digits 0123456789 and 3.14159, -42",
    "punctuation !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "it's we're they've I'm you'll he'd",
    "café naïve résumé é",
    "中文字符测试，标点。",
    "emoji 😀👍🏽 family 👨‍👩‍👧",
    "mixed: x² ≤ ∞ — «quotes» \u00a0nbsp",
    f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n",
    f"answer 12{EOS_TOKEN}",
    "",
    "\n",
    " ",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """A tiny model and its tokenizer saved to disk, plus the in-memory originals."""
    model = build_tiny_model(TinyModelConfig(), tokenizer)
    path = tmp_path_factory.mktemp("tiny")
    save_model(model, tokenizer, path)
    return path, model


def test_vocabulary_is_bytes_then_specials(tokenizer):
    assert len(tokenizer) == 259
    assert tokenizer.convert_ids_to_tokens([32, 10, 65]) == ["Ġ", "Ċ", "A"]
    assert tokenizer.convert_tokens_to_ids([EOS_TOKEN, IM_START, IM_END]) == [256, 257, 258]
    assert tokenizer.eos_token == tokenizer.pad_token == EOS_TOKEN
    # Every byte is one token, in byte order.
    assert tokenizer("AB z", add_special_tokens=False)["input_ids"] == [65, 66, 32, 122]


@pytest.mark.parametrize("text", TEXTS)
def test_lossless_in_memory(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    specials = sum(text.count(t) for t in (EOS_TOKEN, IM_START, IM_END))
    plain = text
    for t in (EOS_TOKEN, IM_START, IM_END):
        plain = plain.replace(t, "")
    assert len(ids) == len(plain.encode("utf-8")) + specials


def test_lossless_on_random_unicode(saved, tokenizer):
    path, _ = saved
    reloaded = AutoTokenizer.from_pretrained(path)
    rng = random.Random(0)
    # Code points from every plane in use, surrogates excluded (they are not encodable UTF-8).
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for _ in range(200):
        text = unicodedata.normalize(
            "NFC", "".join(chr(rng.choice(points)) for _ in range(rng.randint(1, 40)))
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text
        assert reloaded(text, add_special_tokens=False)["input_ids"] == ids


def test_nfc_normalisation_is_the_only_change(tokenizer):
    decomposed = "cafe\u0301"  # e + combining acute
    ids = tokenizer(decomposed, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", decomposed) == "café"


def test_autotokenizer_round_trip_identical(saved, tokenizer):
    path, _ = saved
    reloaded = AutoTokenizer.from_pretrained(path)
    assert isinstance(reloaded, Qwen2Tokenizer)  # config.json says model_type qwen2
    assert len(reloaded) == len(tokenizer)
    assert (reloaded.eos_token_id, reloaded.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert reloaded(text, add_special_tokens=False)["input_ids"] == ids, text
        assert reloaded.decode(ids) == text
    assert reloaded.decode([257, 104, 105, 256], skip_special_tokens=True) == "hi"


def test_load_model_gives_identical_logits(saved, tokenizer):
    path, model = saved
    loaded, loaded_tokenizer = load_model(str(path))
    assert isinstance(loaded, Qwen2ForCausalLM) and loaded.dtype == torch.float32
    ids = torch.tensor([encode_prompt(loaded_tokenizer, "12+3*4=")])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        actual = loaded(input_ids=ids).logits
    assert torch.equal(expected, actual)
    assert loaded_tokenizer.pad_token == EOS_TOKEN


def test_build_is_seeded_and_leaves_global_rng_alone(tokenizer):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_tiny_model(TinyModelConfig(), tokenizer)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_tiny_model(TinyModelConfig(), tokenizer)
    c = build_tiny_model(TinyModelConfig(seed=1), tokenizer)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)


def test_parameter_count_of_default_config(tokenizer):
    model = build_tiny_model(TinyModelConfig(), tokenizer)
    count = sum(p.numel() for p in model.parameters())
    print(f"tiny model parameters: {count:,}")
    assert (
        count == 1_018_368
    )  # 259x128 tied embedding + 4 x (attention 49,408 + MLP 196,608 + norms 256) + 128
    assert model.config.vocab_size == 259 and model.config.eos_token_id == 256
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_chat_template_renders(saved, tokenizer):
    path, _ = saved
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    expected = f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\n2+2={IM_END}\n{IM_START}assistant\n"
    for tok in (tokenizer, AutoTokenizer.from_pretrained(path)):
        ids = encode_prompt(tok, messages=messages)
        assert tok.decode(ids) == expected
        assert ids[0] == 257 and ids.count(258) == 2
        assert ids == encode_prompt(tok, expected)  # specials in plain text map to the same ids


def test_encode_prompt_plain_adds_nothing(tokenizer):
    assert encode_prompt(tokenizer, "1+1=") == [49, 43, 49, 61]


def test_encode_prompt_errors(tokenizer):
    with pytest.raises(ValueError, match="exactly one"):
        encode_prompt(tokenizer, "x", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="exactly one"):
        encode_prompt(tokenizer)
    no_template = build_tiny_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(no_template, messages=[{"role": "user", "content": "x"}])


def test_load_model_errors(tmp_path):
    with pytest.raises(OSError, match="no local directory and the hub is unreachable/offline"):
        load_model("trustbatch-test-org/no-such-model")
    with pytest.raises(FileNotFoundError, match="no local directory"):
        load_model(str(tmp_path / "missing" / "dir"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))  # exists but empty
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load model from directory"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), dtype="float64")


def test_tiny_config_validation():
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TinyModelConfig), {"num_layers": 2}))
    assert isinstance(cfg, TinyModelConfig) and cfg.num_layers == 2
    with pytest.raises(ValueError, match="model.tiny.num_heads"):
        TinyModelConfig(hidden_size=130, num_heads=4)
    with pytest.raises(ValueError, match="model.tiny.num_kv_heads"):
        TinyModelConfig(num_heads=4, num_kv_heads=3)
