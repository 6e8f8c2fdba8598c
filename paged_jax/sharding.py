"""Sharding over a ``jax.sharding.Mesh``: tensor parallel over KV heads, data parallel over pools.

A mesh has a ``"tp"`` axis (tensor parallel; size 1 for none) and optionally a ``"dp"`` axis
(data parallel). Nothing here distributes work by hand: the parameters, the cache and the
allocator state are placed with ``NamedSharding``s and XLA's SPMD partitioner (GSPMD) inserts
the collectives; only the Pallas decode kernel, which XLA cannot partition, runs per shard
under ``jax.shard_map``.

Tensor parallel (Megatron-style), ``PARAM_SPECS``:

* q/k/v and gate/up weights ``[H * D, E]`` / ``[F, E]`` (``[out, in]``) are column-parallel,
  ``P("tp", None)`` (their biases ``P("tp")``): a contiguous shard of q/k/v's outputs holds
  whole heads, and whole GQA groups, because ``tp`` divides ``num_kv_heads`` (and so
  ``num_heads``, a multiple of it);
* o and down weights ``[E, H * D]`` / ``[E, F]`` are row-parallel, ``P(None, "tp")``: each
  shard's partial product is summed by one all-reduce (their biases are replicated, added
  once after it);
* a model that holds its weights ``[in, out]`` (``Linear``'s ``kernel``; ``Llama(in_out=
  True)``, f32 on CPU by default) has the same splits with the axes swapped;
* fused ``qkv_proj`` and ``gate_up_proj`` (``Llama(fused_projections=True)``, the default for
  f32 on CPU) are column-parallel too: their rows are grouped by KV head (q/k/v) and by column of
  ``F`` (gate/up), so a contiguous shard holds whole heads of q, k and v, or the same columns
  of gate and up, as the unfused splits do;
* embeddings, norms and the lm_head are replicated.

The K/V buffers ``[layers, kv_heads, blocks, block_size, head_dim]`` are ``CACHE_SPEC =
P(None, "tp")``: each shard holds its heads of every block. The ``BlockState`` is replicated:
block ids are global, and every head shard reads the same tables.

Data parallel: each ``"dp"`` index is a replica with its own pool and ``BlockState`` on the
sub-mesh of its row of devices (``replica_meshes``); ``engine.data_parallel`` routes requests.

Multi-host: after ``jax.distributed.initialize()`` every process runs the same program;
``jax.devices()`` lists every host's devices, and a mesh built from them shards across hosts.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paged_jax.kvcache import KVCache, init_cache

TP, DP = "tp", "dp"
AXES = (DP, TP)

CACHE_SPEC = P(None, TP)  # [layers, kv_heads / tp, blocks, block_size, head_dim] per shard
# (module, leaf) -> spec; every other parameter is replicated.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")
_ROW = ("o_proj", "down_proj")
PARAM_SPECS = {
    **{(m, "weight"): P(TP, None) for m in _COLUMN},  # [out, in]
    **{(m, "kernel"): P(None, TP) for m in _COLUMN},  # [in, out]
    **{(m, "bias"): P(TP) for m in _COLUMN},
    **{(m, "weight"): P(None, TP) for m in _ROW},
    **{(m, "kernel"): P(TP, None) for m in _ROW},
}


def check_mesh(mesh, *, allow_dp: bool = False) -> None:
    """Raise ``ValueError`` unless ``mesh`` is a ``Mesh`` with a ``"tp"`` axis and no axes but
    ``"tp"`` and ``"dp"`` (``"dp"`` of size 1 unless ``allow_dp``: one engine is one
    replica)."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh. Got {type(mesh).__name__}.")
    names = tuple(mesh.axis_names)
    unknown = [a for a in names if a not in AXES]
    if unknown:
        raise ValueError(f"mesh axes must be among {AXES}. Got {names}; unknown: {unknown}.")
    if TP not in names:
        raise ValueError(f"mesh needs a {TP!r} axis (size 1 for no tensor parallelism). "
                         f"Got axes {names}.")
    dp = mesh.shape.get(DP, 1)
    if dp != 1 and not allow_dp:
        raise ValueError(f"One engine is one replica: its mesh's {DP!r} axis must have size 1. "
                         f"Got {DP}={dp}; give a mesh with a {DP!r} axis to LLM or "
                         f"DataParallelEngine, which build one engine per replica.")


def auto_axes(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis ``AxisType.Auto``. The steps leave the sharding of their
    intermediates to XLA's propagation; on an ``Explicit`` axis (``jax.make_mesh``'s default)
    every reshape of a sharded array would have to name its output sharding."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def tp_size(mesh: Mesh) -> int:
    return mesh.shape[TP]


def check_heads(num_kv_heads: int, mesh: Mesh) -> None:
    """Raise ``ValueError`` unless ``tp`` divides ``num_kv_heads`` (then it divides the query
    heads too: GQA has a whole number of them per KV head)."""
    tp = tp_size(mesh)
    if num_kv_heads % tp:
        raise ValueError(f"The mesh's tp={tp} must divide num_kv_heads={num_kv_heads}: each "
                         f"shard holds whole KV heads and their query groups.")


def check_model(config, mesh: Mesh, *, allow_dp: bool = False) -> None:
    """``check_mesh``, then every dimension a ``ModelConfig`` shards divisible by ``tp``."""
    check_mesh(mesh, allow_dp=allow_dp)
    check_heads(config.num_kv_heads, mesh)
    tp = tp_size(mesh)
    if config.intermediate_size % tp:
        raise ValueError(f"The mesh's tp={tp} must divide intermediate_size="
                         f"{config.intermediate_size} (gate/up/down are split over it).")


def _key(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "idx", entry)))


def param_specs(params) -> dict:
    """The ``PartitionSpec`` of every leaf of ``params`` (``nnx.to_pure_dict`` of a Llama's
    state), by its module and leaf name (``PARAM_SPECS``)."""
    def spec(path, _):
        names = tuple(_key(e) for e in path[-2:])
        return PARAM_SPECS.get(names, P())

    return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(params, mesh: Mesh):
    """``params`` (a pure dict) placed on ``mesh`` by ``param_specs``. Raises ``ValueError``
    naming the parameter whose sharded dimension ``tp`` does not divide."""
    specs = param_specs(params)
    tp = tp_size(mesh)

    def place(path, x, spec):
        for dim, axis in enumerate(spec):
            if axis == TP and x.shape[dim] % tp:
                name = "/".join(_key(e) for e in path)
                raise ValueError(f"Parameter {name} {tuple(x.shape)}: dimension {dim} "
                                 f"({x.shape[dim]}) is not divisible by the mesh's tp={tp}.")
        return NamedSharding(mesh, spec)

    shardings = jax.tree_util.tree_map_with_path(place, params, specs)
    return jax.device_put(params, shardings)


def cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, CACHE_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_cache(kv: KVCache, mesh: Mesh) -> KVCache:
    """``kv`` split over its KV heads (``CACHE_SPEC``)."""
    check_heads(kv.k.shape[1], mesh)
    return jax.device_put(kv, cache_sharding(mesh))


def init_sharded_cache(model, cache, mesh: Mesh, fill: float = 0.0) -> KVCache:
    """``init_cache`` made in place on ``mesh``: each device allocates only its own shard."""
    check_heads(model.num_kv_heads, mesh)
    make = jax.jit(lambda: init_cache(model, cache, fill=fill),
                   out_shardings=cache_sharding(mesh))
    return make()


def replicate(tree, mesh: Mesh):
    """Every leaf of ``tree`` (the ``BlockState``, say) copied to every device of ``mesh``."""
    return jax.device_put(tree, replicated(mesh))


def constrain(kv: KVCache, state, mesh: Mesh | None):
    """Inside a jitted step: keep the outputs' cache and state on their input shardings, so
    that the donated buffers alias their outputs on every shard. No-op without a mesh."""
    if mesh is None:
        return kv, state
    kv = jax.lax.with_sharding_constraint(kv, cache_sharding(mesh))
    return kv, jax.lax.with_sharding_constraint(state, replicated(mesh))


def per_head_shard(fn: Callable, mesh: Mesh) -> Callable:
    """``fn(q, k_pages, v_pages, block_tables, context_lens) -> out`` run per tp shard under
    ``jax.shard_map``: q ``[S, Hq, D]`` and out split over their heads, the pages ``[layers,
    Hkv, blocks, block_size, D]`` over KV heads, tables ``[S, M]`` and lengths ``[S]``
    replicated. Each shard's heads and pages are whole GQA groups, so no communication."""
    heads = P(None, TP)
    return jax.shard_map(fn, mesh=mesh, in_specs=(heads, heads, heads, P(), P()),
                         out_specs=heads, check_vma=False)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ``("tp",)`` mesh per ``"dp"`` index: that row of ``mesh``'s devices (the whole mesh
    when it has no ``"dp"`` axis)."""
    check_mesh(mesh, allow_dp=True)
    names = list(mesh.axis_names)
    devices = np.asarray(mesh.devices)
    if DP not in names:
        return [Mesh(devices, (TP,))]
    devices = np.transpose(devices, (names.index(DP), names.index(TP)))
    return [Mesh(row, (TP,)) for row in devices]
