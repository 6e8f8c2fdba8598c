"""The transformers servers ``paged-jax bench serve`` compares paged_jax with: static
``generate`` (``StaticServer``) and continuous batching (``BatchServer``, ``generate_batch``'s
manager). Both serve a list of ``Request``s at their arrival offsets and return what a client
would have seen of each (``Timing``); see ``bench_serve``'s docstring for how each is fed."""

from __future__ import annotations

import collections
import time

from paged_jax.engine.serve_metrics import Request, Timing

__all__ = ["BatchServer", "StaticServer"]


class _StepClock:
    """A stopping criterion that never stops: it records when each generation step ends."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class StaticServer:
    """transformers' static ``generate``: arrival-order batches of at most the batch limit."""


    def __init__(self, model, pad_id: int):
        self.model, self.pad_id = model, pad_id

    def serve(self, requests: list[Request], max_num_seqs: int) -> list[Timing]:
        import torch
        from transformers import GenerationConfig, StoppingCriteriaList

        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        start, timings, k = time.perf_counter(), {}, 0
        while k < len(order):
            first = start + requests[order[k]].arrival
            time.sleep(max(0.0, first - time.perf_counter()))
            now = time.perf_counter()
            batch = [order[k]]
            while (len(batch) < max_num_seqs and k + len(batch) < len(order)
                   and start + requests[order[k + len(batch)]].arrival <= now):
                batch.append(order[k + len(batch)])
            k += len(batch)
            prompts = [list(requests[i].prompt) for i in batch]
            width, new = max(map(len, prompts)), max(requests[i].output_len for i in batch)
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            clock = _StepClock()
            config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1,
                                      pad_token_id=self.pad_id)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask,
                                          generation_config=config,
                                          stopping_criteria=StoppingCriteriaList([clock]))
            end = time.perf_counter()
            for row, i in enumerate(batch):
                r = requests[i]
                made = out[row, width:width + r.output_len].tolist()
                timings[i] = Timing(start + r.arrival, clock.times[:r.output_len], end,
                                    len(r.prompt), made)
        return [timings[i] for i in range(len(requests))]


class BatchServer:
    """transformers' continuous batching (``generate_batch``'s manager), fed at arrival."""


    def __init__(self, model, args, num_blocks: int):
        self.model, self.args, self.num_blocks = model, args, num_blocks

    def serve(self, requests: list[Request], max_num_seqs: int) -> list[Timing]:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        a = self.args
        config = GenerationConfig(do_sample=False, eos_token_id=-1,
                                  max_new_tokens=max(r.output_len for r in requests))
        cb = ContinuousBatchingConfig(
            page_size=a.block_size, num_blocks=self.num_blocks,
            max_batch_tokens=a.max_num_batched_tokens, max_requests_per_batch=max_num_seqs)
        pending = collections.deque(sorted(enumerate(requests), key=lambda x: x[1].arrival))
        timings = {}
        with self.model.continuous_batching_context_manager(
                generation_config=config, continuous_batching_config=cb, block=True,
                timeout=5) as manager:
            start = time.perf_counter()
            while len(timings) < len(requests):
                now = time.perf_counter()
                while pending and start + pending[0][1].arrival <= now:
                    i, r = pending.popleft()
                    manager.add_request(input_ids=list(r.prompt), request_id=str(i),
                                        max_new_tokens=r.output_len, record_timestamps=True)
                wait = 0.05 if not pending else max(
                    1e-3, start + pending[0][1].arrival - time.perf_counter())
                result = manager.get_result(timeout=wait)
                if result is None or not result.is_finished():
                    if result is None and not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped")
                    continue
                if result.error is not None:
                    raise RuntimeError(f"generate_batch request {result.request_id} failed: "
                                       f"{result.error}")
                i = int(result.request_id)
                r, times = requests[i], list(result.timestamps or [])
                timings[i] = Timing(start + r.arrival, times, max(times[-1], result.lifespan[1]),
                                    len(r.prompt), list(result.generated_tokens))
        return [timings[i] for i in range(len(requests))]
