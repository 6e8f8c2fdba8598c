"""A Llama-family decoder in Flax NNX: RMSNorm, RoPE (with llama3 scaling), GQA, SwiGLU.

The model owns no cache. Each attention layer computes its rotated q/k/v and hands them to an
``attend`` function together with whatever cache pytree the caller threads through the layers:

    attend(layer, q, k, v, cache) -> (out, cache)
      q: [B, T, num_heads, head_dim]; k, v: [B, T, num_kv_heads, head_dim]
      out: [B, T, num_heads, head_dim]

so one set of weights serves the dense no-cache forward pass (the default, used as the
reference), the paged prefill and decode steps (``paged_jax.engine``) and the contiguous-cache
baseline of the benchmark. Attribute names follow Hugging Face's so checkpoints map 1:1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.model.config import ModelConfig, cpu_16bit

AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]

# On CPU, a 16-bit projection of at most this many rows puts its weight on the left by
# default (`project`); beyond it the activations on the left run faster.
WEIGHT_LEFT_MAX_ROWS = 64


def in_out_default(dtype, platform: str | None = None) -> bool:
    """Whether a ``Llama`` stores its projections' weights ``[in, out]`` by default: f32 on
    XLA:CPU (``platform``, default JAX's default backend), whose matmuls of a few rows run
    faster with the weight in that layout (``paged-jax bench decode`` measures it). Anywhere
    else the checkpoints' ``[out, in]``."""
    return (jnp.dtype(dtype) == jnp.float32
            and (platform or jax.default_backend()) == "cpu")


def fused_default(dtype, platform: str | None = None) -> bool:
    """Whether a ``Llama`` fuses its q/k/v and its gate/up projections by default: f32 on
    XLA:CPU (``platform``, default JAX's default backend), where each matmul of a decode
    step's few rows costs a fixed overhead beside its work, so two matmuls in place of five
    per layer run faster. ``paged-jax bench decode`` times the other choice in every run;
    bf16 on CPU measured no gain, and elsewhere it is unmeasured."""
    return in_out_default(dtype, platform)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, computed as transformers does (in f32)."""
    d = config.head_dim
    inv_freq = 1.0 / (
        np.float32(config.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    )
    inv_freq = inv_freq.astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    # Llama 3: long wavelengths are slowed down by `factor`, short ones kept, a smooth ramp
    # in between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: jax.Array,  # [B, T, H, D]
    positions: jax.Array,  # [B, T] int32
    inv_freq: np.ndarray,  # [D // 2] float32
) -> jax.Array:  # [B, T, H, D], x.dtype
    """Rotate-half RoPE (the Hugging Face convention: the two halves of D pair up)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def masked_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k: jax.Array,  # [B, S, Hkv, D]
    v: jax.Array,  # [B, S, Hkv, D]
    mask: jax.Array,  # [B, T, S] bool, true = may attend
    *,
    per_kv_head: bool = True,
) -> jax.Array:  # [B, T, Hq, D]
    """GQA softmax attention (f32 logits and softmax) under an explicit mask: the values of
    ``jax.nn.dot_product_attention(implementation="xla")``, which ``per_kv_head=False`` calls.

    By default each KV head's attention is its own pair of dots, batched over ``B`` only,
    with the head's ``G = Hq // Hkv`` query heads stacked as ``G * T`` rows against its
    ``S`` keys: ``[B, G*T, D] x [B, S, D]``, then ``[B, G*T, S] x [B, S, D]``. The scores
    and probabilities stay in that layout from one dot to the next. XLA:CPU runs these faster
    than the dots over ``[B, Hkv, G, T]`` that ``dot_product_attention`` makes
    (``paged-jax bench decode`` times a prefill both ways and prints the ratio).
    """
    # Masked keys and values are zeroed so that whatever a slot holds (NaN in a poisoned or
    # never-written block) cannot leak into the output through 0 * NaN.
    key_live = jnp.any(mask, axis=1)[:, :, None, None]  # [B, S, 1, 1]
    k = jnp.where(key_live, k, 0)
    v = jnp.where(key_live, v, 0)
    if not per_kv_head:
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")
    batch, seq, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    group = num_heads // num_kv
    # Query head h attends with KV head h // group, as in dot_product_attention.
    rows = q.reshape(batch, seq, num_kv, group, head_dim).transpose(2, 0, 3, 1, 4)
    rows = rows.reshape(num_kv, batch, group * seq, head_dim)  # [Hkv, B, G*T, D]
    row_mask = jnp.broadcast_to(mask[:, None], (batch, group, *mask.shape[1:]))
    row_mask = row_mask.reshape(batch, group * seq, -1)  # [B, G*T, S]
    scale = jnp.float32(head_dim ** -0.5)
    outs = []
    for h in range(num_kv):
        scores = jax.lax.dot_general(rows[h], k[:, :, h], (((2,), (2,)), ((0,), (0,))),
                                     preferred_element_type=jnp.float32)  # [B, G*T, S]
        scores = jnp.where(row_mask, scores * scale, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jax.lax.dot_general(probs, v[:, :, h], (((2,), (1,)), ((0,), (0,))),
                                  preferred_element_type=jnp.float32)  # [B, G*T, D]
        outs.append(out.astype(q.dtype))
    out = jnp.stack(outs).reshape(num_kv, batch, group, seq, head_dim)
    return out.transpose(1, 3, 0, 2, 4).reshape(batch, seq, num_heads, head_dim)


def causal_attend(positions: jax.Array, lengths: jax.Array | None = None, *,
                  per_kv_head: bool = True) -> AttendFn:
    """The no-cache ``attend``: token t sees tokens at positions <= its own (and < length).
    ``per_kv_head``: ``masked_attention``'s."""
    batch, seq = positions.shape
    valid = jnp.ones((batch, seq), bool)
    if lengths is not None:
        valid = jnp.arange(seq)[None, :] < lengths[:, None]  # [B, T]
    mask = (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]  # [B, T, T]

    def attend(layer, q, k, v, cache):
        return masked_attention(q, k, v, mask, per_kv_head=per_kv_head), cache

    return attend


def dense_dot_general(
    lhs: jax.Array,  # [..., K]: the activations, or a weight [out, K] on the left
    rhs: jax.Array,  # the other operand, K on the axis dimension_numbers names
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    **kwargs,
) -> jax.Array:
    """``jax.lax.dot_general`` for the model's weights, with 16-bit operands accumulated in f32
    and the result rounded once, to ``preferred_element_type`` or else their dtype (what a
    bf16 matmul means on every backend; the logits ask for f32 and are not rounded at all).

    Asked for as such, XLA:CPU runs a bf16 matmul on the CPU's bf16 units (AMX, AVX-512
    BF16); a bf16 dot with a bf16 result is instead computed in f32 by a slow generic loop, as
    is a bf16 dot of a single row (or, with the weight on the left, a single column) even
    with an f32 result. On CPU such a row of ``lhs`` (or column of a 2-D ``rhs``) is therefore
    duplicated to two and the spare result dropped. Other operands take ``lax.dot_general``
    unchanged.
    """
    if lhs.dtype.itemsize != 2 or rhs.dtype != lhs.dtype:
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
    out_dtype = preferred_element_type or lhs.dtype
    (lhs_contract, rhs_contract), batch_dims = dimension_numbers
    pad = cpu_16bit(lhs.dtype) and batch_dims == ((), ())
    one_row = (pad and tuple(lhs_contract) == (lhs.ndim - 1,)
               and math.prod(lhs.shape[:-1]) == 1)
    one_col = (pad and not one_row and rhs.ndim == 2 and len(rhs_contract) == 1
               and rhs.shape[1 - rhs_contract[0]] == 1)
    lhs_shape = lhs.shape
    if one_row:
        lhs = jnp.concatenate([lhs.reshape(1, -1)] * 2)  # [2, K]
        dimension_numbers = (((1,), rhs_contract), batch_dims)
    if one_col:
        rhs = jnp.concatenate([rhs, rhs], axis=1 - rhs_contract[0])
    y = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                            preferred_element_type=jnp.float32, **kwargs).astype(out_dtype)
    if one_row:
        return y[:1].reshape(*lhs_shape[:-1], y.shape[-1])
    return y[..., :1] if one_col else y


def project(
    x: jax.Array,  # [..., in]
    weight: jax.Array,  # [out, in], as PyTorch and GGUF store it; [in, out] with in_out
    *,
    dot_general=dense_dot_general,
    weight_left_rows: int = WEIGHT_LEFT_MAX_ROWS,
    preferred_element_type=None,
    in_out: bool = False,
) -> jax.Array:  # [..., out]
    """``x @ weight.T`` (``x @ weight`` with ``in_out``). A 16-bit ``[out, in]`` weight on
    CPU times at most ``weight_left_rows`` rows is computed the other way round, ``weight @
    rows.T``, and the ``[out, rows]`` result transposed back: XLA:CPU's bf16 matmul of a few
    rows streams the weight faster that way, each output row reading one contiguous row of
    ``weight`` (``paged-jax bench decode --dtype bfloat16`` measures the difference it makes
    to decoding, which depends on the CPU); from about a hundred rows on the activations on
    the left are the faster."""
    kw = dict(preferred_element_type=preferred_element_type)
    if in_out:
        return dot_general(x, weight, (((x.ndim - 1,), (0,)), ((), ())), **kw)
    rows = math.prod(x.shape[:-1])
    if not (cpu_16bit(weight.dtype) and rows <= weight_left_rows):
        return dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())), **kw)
    y = dot_general(weight, x.reshape(rows, -1), (((1,), (1,)), ((), ())), **kw)  # [out, n]
    return y.T.reshape(*x.shape[:-1], weight.shape[0])


class TransposedParam:
    """A ``[in, out]`` parameter seen as the ``[out, in]`` tensor a checkpoint stores:
    ``get_value()`` and ``set_value()`` transpose, so loaders and tests address every
    projection's weight in the checkpoints' layout (``Linear.checkpoint_weight``)."""

    def __init__(self, param: nnx.Param):
        self.param = param

    def get_value(self) -> jax.Array | jax.ShapeDtypeStruct:  # [out, in]
        value = self.param.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):  # an abstract model (``nnx.eval_shape``)
            return jax.ShapeDtypeStruct(value.shape[::-1], value.dtype)
        return value.T

    def set_value(self, value) -> None:  # value [out, in]
        self.param.set_value(jnp.asarray(value).T)


class PartParam:
    """One part of a fused ``Linear``'s ``[out, in]`` weight (or ``[out]`` bias) seen as the
    tensor a checkpoint stores for it: rows ``[start, stop)`` of each of the ``groups``
    groups of ``width`` rows the fused tensor is made of. ``get_value()`` gathers them,
    ``set_value()`` writes them back (into a NaN-filled tensor when the model is abstract,
    as a loader finds it), so loaders and tests address the part by its checkpoint name."""

    def __init__(self, whole, groups: int, width: int, start: int, stop: int):
        self.whole, self.groups, self.width = whole, groups, width
        self.start, self.stop = start, stop

    def get_value(self) -> jax.Array | jax.ShapeDtypeStruct:  # [groups * (stop - start), ...]
        value = self.whole.get_value()
        rows = self.groups * (self.stop - self.start)
        if isinstance(value, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((rows, *value.shape[1:]), value.dtype)
        grouped = value.reshape(self.groups, self.width, *value.shape[1:])
        return grouped[:, self.start:self.stop].reshape(rows, *value.shape[1:])

    def set_value(self, value) -> None:
        whole = self.whole.get_value()
        if isinstance(whole, jax.ShapeDtypeStruct):
            whole = jnp.full(whole.shape, jnp.nan, whole.dtype)
        rest = whole.shape[1:]
        part = jnp.asarray(value, whole.dtype).reshape(self.groups, self.stop - self.start, *rest)
        grouped = whole.reshape(self.groups, self.width, *rest)
        self.whole.set_value(grouped.at[:, self.start:self.stop].set(part).reshape(whole.shape))


class Linear(nnx.Module):
    """``y = x @ weight.T + bias`` with ``weight`` ``[out, in]``, the layout Hugging Face and
    GGUF checkpoints store, so that loading copies no transpose; computed by ``project``.
    With ``in_out`` the weight is held ``[in, out]`` instead, as ``kernel`` (``y = x @
    kernel + bias``), the layout in which XLA:CPU multiplies a few rows by an f32 weight
    fastest (``in_out_default``). ``checkpoint_weight()`` is the weight in the checkpoints'
    layout either way.

    ``out_features`` a tuple: several projections of the same input fused into one matmul
    (q/k/v, gate/up), each part's ``out`` rows split into ``groups`` equal groups and the
    groups interleaved, ``[group 0 of every part, group 1 of every part, ...]``. So a
    contiguous run of groups holds whole heads of every part (``groups`` = KV heads for
    q/k/v), and tensor parallelism shards the fused output exactly as it shards the parts.
    ``split(y)`` gives the parts' outputs, ``part(i)`` the part as a checkpoint addresses it.
    Drawn at random part by part, in order: the same values as separate ``Linear``s."""

    def __init__(self, in_features: int, out_features: int | tuple[int, ...], *,
                 use_bias: bool, dtype, rngs: nnx.Rngs, dot_general=dense_dot_general,
                 weight_left_rows: int = WEIGHT_LEFT_MAX_ROWS, preferred_element_type=None,
                 in_out: bool = False, groups: int = 1):
        parts = (out_features,) if isinstance(out_features, int) else tuple(out_features)
        if groups < 1 or any(n % groups for n in parts):
            raise ValueError(f"groups={groups} must divide every part of out_features "
                             f"{parts}.")
        self.in_out, self.parts, self.groups = in_out, parts, groups
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=0)
        # Drawn [out, in] part by part, either layout: one seed, one model.
        drawn = [init(rngs.params(), (n, in_features), dtype) for n in parts]
        weight = self._interleave(drawn)
        if in_out:
            self.kernel = nnx.Param(weight.T)
        else:
            self.weight = nnx.Param(weight)
        self.bias = nnx.Param(jnp.zeros((sum(parts),), dtype)) if use_bias else None
        self.dot_general, self.weight_left_rows = dot_general, weight_left_rows
        self.preferred_element_type = preferred_element_type

    def _interleave(self, drawn: list[jax.Array]) -> jax.Array:  # parts' [n_i, in] -> [out, in]
        if len(drawn) == 1:
            return drawn[0]
        g = self.groups
        grouped = [w.reshape(g, w.shape[0] // g, -1) for w in drawn]
        return jnp.concatenate(grouped, axis=1).reshape(sum(self.parts), -1)

    def checkpoint_weight(self) -> nnx.Param | TransposedParam:
        """The weight as checkpoints store it, ``[out, in]``, for ``get_value()`` and
        ``set_value()``: the parameter itself, or a ``TransposedParam`` over ``kernel``."""
        return TransposedParam(self.kernel) if self.in_out else self.weight

    def part(self, i: int) -> LinearPart:
        """Part ``i`` of a fused ``Linear``, with ``checkpoint_weight()`` and ``bias`` views as
        a ``Linear`` of its own has."""
        return LinearPart(self, i)

    def split(self, y: jax.Array) -> tuple[jax.Array, ...]:  # [..., out] -> parts' [..., n_i]
        """The parts' outputs from ``y``, this ``Linear``'s output."""
        if len(self.parts) == 1:
            return (y,)
        g = self.groups
        grouped = y.reshape(*y.shape[:-1], g, -1)
        edges = np.cumsum([0] + [n // g for n in self.parts])
        return tuple(grouped[..., a:b].reshape(*y.shape[:-1], n)
                     for a, b, n in zip(edges[:-1], edges[1:], self.parts, strict=True))

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        weight = (self.kernel if self.in_out else self.weight)[...]
        y = project(x.astype(weight.dtype), weight, dot_general=self.dot_general,
                    weight_left_rows=self.weight_left_rows,
                    preferred_element_type=self.preferred_element_type, in_out=self.in_out)
        return y if self.bias is None else y + self.bias[...]


class LinearPart:
    """Part ``index`` of a fused ``Linear``, as loaders and tests address a projection:
    ``checkpoint_weight()`` ``[n, in]`` and ``bias`` (``[n]``, or None) are ``PartParam``
    views into the fused parameters."""

    def __init__(self, linear: Linear, index: int):
        g = linear.groups
        widths = [n // g for n in linear.parts]
        start = sum(widths[:index])
        self._view = lambda whole: PartParam(whole, g, sum(widths), start,
                                             start + widths[index])
        self.linear = linear
        self.bias = None if linear.bias is None else self._view(linear.bias)

    def checkpoint_weight(self) -> PartParam:
        return self._view(self.linear.checkpoint_weight())


class Attention(nnx.Module):
    """Self-attention: ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (Hugging Face's
    names), or with ``fused`` one ``qkv_proj`` making q, k and v in one matmul, grouped by
    KV head (``Linear``); ``projection(name)`` addresses q/k/v either way."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dot_general=dense_dot_general,
                 weight_left_rows: int = WEIGHT_LEFT_MAX_ROWS, in_out: bool = False,
                 fused: bool = False):
        self.config = config
        e, d = config.hidden_size, config.head_dim
        kw = dict(dtype=config.jnp_dtype, dot_general=dot_general,
                  weight_left_rows=weight_left_rows, rngs=rngs, in_out=in_out)
        q, kv = config.num_heads * d, config.num_kv_heads * d
        if fused:
            self.qkv_proj = Linear(e, (q, kv, kv), use_bias=config.qkv_bias,
                                   groups=config.num_kv_heads, **kw)
        else:
            self.q_proj = Linear(e, q, use_bias=config.qkv_bias, **kw)
            self.k_proj = Linear(e, kv, use_bias=config.qkv_bias, **kw)
            self.v_proj = Linear(e, kv, use_bias=config.qkv_bias, **kw)
        self.o_proj = Linear(config.num_heads * d, e, use_bias=config.o_bias, **kw)

    def projection(self, name: str) -> Linear | LinearPart:
        """``"q_proj"``, ``"k_proj"``, ``"v_proj"`` or ``"o_proj"``: the ``Linear``, or the
        part of ``qkv_proj`` that computes it."""
        return _projection(self, name, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x`` [..., E] -> q [..., Hq * D], k and v [..., Hkv * D]."""
        if hasattr(self, "qkv_proj"):
            return self.qkv_proj.split(self.qkv_proj(x))
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def __call__(self, x, positions, inv_freq, layer: int, attend: AttendFn, cache):
        cfg = self.config
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x)
        q = q.reshape(batch, seq, cfg.num_heads, cfg.head_dim)  # [B, T, Hq, D]
        k = k.reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # [B, T, Hkv, D]
        v = v.reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # [B, T, Hkv, D]
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        out, cache = attend(layer, q, k, v, cache)  # [B, T, Hq, D]
        return self.o_proj(out.reshape(batch, seq, -1)), cache


class MLP(nnx.Module):
    """SwiGLU: ``gate_proj``, ``up_proj`` and ``down_proj``, or with ``fused`` one
    ``gate_up_proj`` making gate and up in one matmul (``Linear``, one group per column, so
    the two interleave); ``projection(name)`` addresses gate/up either way."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dot_general=dense_dot_general,
                 weight_left_rows: int = WEIGHT_LEFT_MAX_ROWS, in_out: bool = False,
                 fused: bool = False):
        e, f = config.hidden_size, config.intermediate_size
        kw = dict(use_bias=config.mlp_bias, dtype=config.jnp_dtype, dot_general=dot_general,
                  weight_left_rows=weight_left_rows, rngs=rngs, in_out=in_out)
        if fused:
            self.gate_up_proj = Linear(e, (f, f), groups=f, **kw)
        else:
            self.gate_proj = Linear(e, f, **kw)
            self.up_proj = Linear(e, f, **kw)
        self.down_proj = Linear(f, e, **kw)

    def projection(self, name: str) -> Linear | LinearPart:
        """``"gate_proj"``, ``"up_proj"`` or ``"down_proj"``: the ``Linear``, or the part of
        ``gate_up_proj`` that computes it."""
        return _projection(self, name, "gate_up_proj", ("gate_proj", "up_proj"))

    def gate_up(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:  # [..., E] -> 2 x [..., F]
        if hasattr(self, "gate_up_proj"):
            return self.gate_up_proj.split(self.gate_up_proj(x))
        return self.gate_proj(x), self.up_proj(x)

    def __call__(self, x):  # [B, T, E]
        gate, up = self.gate_up(x)  # [B, T, F] each
        # SiLU in f32, rounded once to the activations' dtype: what PyTorch's SiLU does for a
        # 16-bit tensor. A 16-bit `nnx.silu` rounds after each of its ops instead, which both
        # changes the values and runs slower on XLA:CPU.
        act = nnx.silu(gate.astype(jnp.float32)).astype(gate.dtype)
        return self.down_proj(act * up)


def _projection(module, name: str, fused: str, parts: tuple[str, ...]) -> Linear | LinearPart:
    if hasattr(module, fused) and name in parts:
        return getattr(module, fused).part(parts.index(name))
    if name not in (*parts, "o_proj", "down_proj") or not hasattr(module, name):
        raise ValueError(f"{type(module).__name__} has no projection {name!r}.")
    return getattr(module, name)


class RMSNorm(nnx.RMSNorm):
    """``nnx.RMSNorm`` (its ``scale`` parameter) computed as transformers' ``LlamaRMSNorm``
    is: normalized in f32, rounded to the input's dtype, then times ``scale`` in that dtype.
    For 16-bit activations that is two roundings where ``nnx.RMSNorm`` makes one; in f32
    the two agree."""

    def __call__(self, x: jax.Array, mask=None) -> jax.Array:  # [..., E] -> [..., E]
        if mask is not None:
            raise ValueError("RMSNorm takes no mask.")
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.epsilon)
        return self.scale[...] * h.astype(x.dtype)


def _rms_norm(config: ModelConfig, rngs: nnx.Rngs) -> RMSNorm:
    return RMSNorm(
        config.hidden_size, epsilon=config.rms_norm_eps, dtype=config.jnp_dtype,
        param_dtype=config.jnp_dtype, rngs=rngs,
    )


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dot_general=dense_dot_general,
                 weight_left_rows: int = WEIGHT_LEFT_MAX_ROWS, in_out: bool = False,
                 fused: bool = False):
        kw = dict(rngs=rngs, dot_general=dot_general, weight_left_rows=weight_left_rows,
                  in_out=in_out, fused=fused)
        self.input_layernorm = _rms_norm(config, rngs)
        self.self_attn = Attention(config, **kw)
        self.post_attention_layernorm = _rms_norm(config, rngs)
        self.mlp = MLP(config, **kw)

    def __call__(self, x, positions, inv_freq, layer, attend, cache):
        h, cache = self.self_attn(
            self.input_layernorm(x), positions, inv_freq, layer, attend, cache
        )
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Llama(nnx.Module):
    """``LlamaForCausalLM`` / ``Qwen2ForCausalLM``: tokens in, f32 logits out.

    ``cpu_16bit_paths=False`` turns off what makes 16-bit weights fast on XLA:CPU (the
    layers' ``dense_dot_general``, a projection of up to ``weight_left_rows`` rows with its
    weight on the left, the embedding gathered as bits), leaving XLA's plain ops: the same
    values, for benchmarks to measure the difference. ``weight_left_rows=0`` turns off the
    weight on the left alone. The output projection keeps ``dense_dot_general`` either way:
    its unrounded f32 logits are part of the values. ``kv_head_attention``: the dense and
    prefill attention's ``masked_attention(per_kv_head=...)``, on every backend.
    ``in_out``: every ``Linear`` holds its weight ``[in, out]`` (as ``kernel``) rather than
    ``[out, in]``; by default (None) where ``in_out_default`` says so, f32 on CPU. The tied
    output projection reads the embedding table ``[vocab, hidden]`` either way.
    ``fused_projections``: each layer makes q/k/v in one matmul (``qkv_proj``) and gate/up in
    another (``gate_up_proj``) rather than five; by default (None) where ``fused_default``
    says so, f32 on CPU. The layers' ``projection(name)`` addresses every projection by its
    checkpoint name either way."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, cpu_16bit_paths: bool = True,
                 weight_left_rows: int = WEIGHT_LEFT_MAX_ROWS, kv_head_attention: bool = True,
                 in_out: bool | None = None, fused_projections: bool | None = None):
        self.config = config
        self.kv_head_attention = kv_head_attention
        self.cpu_16bit_paths = cpu_16bit_paths
        self.weight_left_rows = weight_left_rows if cpu_16bit_paths else 0
        self.in_out = in_out_default(config.jnp_dtype) if in_out is None else in_out
        self.fused_projections = (fused_default(config.jnp_dtype) if fused_projections is None
                                  else fused_projections)
        dot_general = dense_dot_general if cpu_16bit_paths else jax.lax.dot_general
        dtype = config.jnp_dtype
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        kw = dict(dot_general=dot_general, weight_left_rows=self.weight_left_rows,
                  in_out=self.in_out, fused=self.fused_projections)
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs, **kw)
                                for _ in range(config.num_layers)])
        self.norm = _rms_norm(config, rngs)
        # Tied models have no lm_head: logits come from the embedding (`logits`).
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype,
            weight_left_rows=self.weight_left_rows, rngs=rngs, in_out=self.in_out,
            preferred_element_type=jnp.float32,  # f32 logits, never rounded
        )

    def hidden(
        self,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32
        cache: Any = None,
        attend: AttendFn | None = None,
        embed_bits: jax.Array | None = None,  # [V, E] uint16: ``embedding_bits()``
    ) -> tuple[jax.Array, Any]:  # ([B, T, E] final-normed hidden states, cache)
        if attend is None:
            attend = causal_attend(positions, per_kv_head=self.kv_head_attention)
        inv_freq = rope_inv_freq(self.config)
        x = self.embed(tokens, embed_bits)  # [B, T, E]
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, positions, inv_freq, i, attend, cache)
        return self.norm(x), cache

    def embed(self, tokens: jax.Array, bits: jax.Array | None = None) -> jax.Array:
        """The tokens' rows of the embedding: ``[B, T]`` int32 -> ``[B, T, E]``.

        On CPU a 16-bit table is gathered as its ``uint16`` bits: XLA:CPU gathers from a bf16
        table by converting all of it to f32 in every dispatch. Reinterpreting the table as
        bits is itself a copy of it in every dispatch, unless the caller passes ``bits``,
        the table's bits made once (``embedding_bits``)."""
        table = self.embed_tokens.embedding[...]  # [V, E]
        if not self.gathers_bits():
            return self.embed_tokens(tokens)
        if bits is None:
            bits = self.embedding_bits()
        elif bits.shape != table.shape or bits.dtype != jnp.uint16:
            raise ValueError(f"embed_bits must be the embedding's bits, uint16 "
                             f"{tuple(table.shape)}. Got {bits.dtype} {tuple(bits.shape)}.")
        return jax.lax.bitcast_convert_type(jnp.take(bits, tokens, axis=0), table.dtype)

    def gathers_bits(self) -> bool:
        """Whether ``embed`` gathers the table as ``uint16`` bits (a 16-bit table on CPU,
        with ``cpu_16bit_paths``)."""
        return self.cpu_16bit_paths and cpu_16bit(self.embed_tokens.embedding.dtype)

    def embedding_bits(self) -> jax.Array | None:
        """``[V, E]`` uint16: the embedding table's bits, for ``embed``'s ``bits``, or None
        where ``embed`` does not gather bits. A serving loop makes them once and passes them
        to every step (``paged_jax.engine.serving_params``): the same bytes again as the
        table (a second copy in memory), where a step that makes them itself copies the
        whole table in every dispatch. Made from the table as it is now: after changing
        the embedding, make them again."""
        if not self.gathers_bits():
            return None
        return jax.lax.bitcast_convert_type(self.embed_tokens.embedding[...], jnp.uint16)

    def logits(self, h: jax.Array) -> jax.Array:  # [..., E] -> [..., V] f32
        if self.lm_head is not None:
            return self.lm_head(h)
        table = self.embed_tokens.embedding[...]  # tied: the table [V, E] is the weight
        return project(h.astype(table.dtype), table, weight_left_rows=self.weight_left_rows,
                       preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions=None, cache=None, attend=None, embed_bits=None):
        """Logits ``[B, T, V]`` (f32) and the updated cache. With no ``attend``, a dense causal
        forward pass over ``tokens`` (positions ``0..T-1`` unless given). ``embed_bits``:
        ``embedding_bits()``, made once by the caller (see ``embed``)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                         tokens.shape)
        h, cache = self.hidden(tokens, positions, cache, attend, embed_bits)
        return self.logits(h), cache


def init_model(config: ModelConfig, seed: int = 0) -> Llama:
    """A randomly initialised model (tests, examples, benchmarks)."""
    return Llama(config, rngs=nnx.Rngs(seed))


def abstract_model(config: ModelConfig) -> Llama:
    """The model with shape-only parameters: nothing is allocated (checkpoint loading)."""
    return nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
