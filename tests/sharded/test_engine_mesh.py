"""The engine on a mesh, against the same engine on one device: a tp=2 run that preempts and
hits the prefix cache, a dp=2 x tp=2 ``LLM`` whose router spreads the requests over both
replicas, and the multi-host code path (``jax.distributed.initialize`` in one process).
Greedy token ids must be equal: a replica reading another's pool, a lost block on
preemption, or a wrong shard after a block copy would change them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from paged_jax.engine.data_parallel import DataParallelEngine
from paged_jax.engine.llm import LLM
from paged_jax.engine.params import SamplingParams
from paged_jax.model import init_model
from tests.sharded.helpers import GQA, mesh

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
# Two prompts share their first 16 tokens (two 8-token blocks) with an earlier one: prefix hits.
LENS = (5, 17, 9, 30, 3, 21)
SMALL = dict(block_size=8, max_num_seqs=4, max_model_len=64, num_blocks=12,
             max_num_batched_tokens=32, steps_per_dispatch=3, debug=True)


def prompts():
    rng = np.random.default_rng(0)
    ps = [rng.integers(0, GQA.vocab_size, n).tolist() for n in LENS]
    return ps + [ps[3][:16] + [7, 8, 9], ps[5][:16] + [1]]


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def model():
    return init_model(GQA, seed=3)


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM.from_model(model, None, **SMALL)
    outs = token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False))
    stats = llm.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0
    return outs


def test_tp2_engine_preempts_and_hits_the_prefix_cache_like_one_device(model, reference):
    llm = LLM.from_model(model, None, mesh=mesh((2,)), **SMALL)
    assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == reference
    stats = llm.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0
    assert llm.engine.kv.k.sharding.spec == llm.engine.kv.v.sharding.spec == P(None, "tp")
    assert llm.engine.state.block_tables.sharding.is_fully_replicated


def test_dp2_tp2_llm_spreads_requests_over_replicas_like_one_device(model, reference):
    llm = LLM.from_model(model, None, mesh=mesh((2, 2), ("dp", "tp")), **SMALL)
    engine = llm.engine
    assert isinstance(engine, DataParallelEngine) and len(engine) == 2
    devices = [set(e.kv.k.sharding.device_set) for e in engine.replicas]
    assert devices == [set(jax.devices()[0:2]), set(jax.devices()[2:4])]
    ids = [f"r{i}" for i in range(len(prompts()))]
    for rid, p in zip(ids, prompts(), strict=True):
        engine.add_request(rid, p, GREEDY)
    # The router sends each new request to the replica with fewer unfinished ones.
    assert [len(e.requests) for e in engine.replicas] == [4, 4]
    with pytest.raises(ValueError, match="'r0' is already in use"):
        engine.add_request("r0", [1, 2, 3], GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert token_ids([done[r] for r in ids]) == reference
    stats = engine.stats()
    assert stats.finished == len(ids) and stats.running == stats.waiting == 0
    assert stats.blocks_total == 2 * SMALL["num_blocks"]
    engine.add_request("late", [1, 2, 3], GREEDY)
    engine.abort_request("late")
    with pytest.raises(KeyError):
        engine.abort_request("late")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MULTIHOST = textwrap.dedent("""
    import json, sys
    import jax
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=1, process_id=0)
    from jax.sharding import AxisType, Mesh
    import numpy as np
    from paged_jax.engine.llm import LLM
    from paged_jax.engine.params import SamplingParams
    from paged_jax.model import init_model
    from tests.sharded.helpers import GQA
    from tests.sharded.test_engine_mesh import SMALL, prompts
    assert jax.process_count() == 1 and jax.device_count() == 8
    # The same code on every host: a mesh over jax.devices(), every process's devices.
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",), axis_types=(AxisType.Auto,))
    llm = LLM.from_model(init_model(GQA, seed=3), None, mesh=mesh, **SMALL)
    outs = llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=10),
                        use_tqdm=False)
    print("TOKENS", json.dumps([[c.token_ids for c in o.outputs] for o in outs]))
    jax.distributed.shutdown()
""")


def test_multihost_code_path_in_one_process(reference):
    """``jax.distributed.initialize`` (one process, a local coordinator), then the mesh from
    ``jax.devices()`` and a tp=2 engine run: the single-device tokens."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", MULTIHOST, f"127.0.0.1:{_free_port()}"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TOKENS "))
    assert json.loads(line[len("TOKENS "):]) == reference
