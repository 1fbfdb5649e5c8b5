"""One vLLM `AsyncLLM` engine in a Ray actor: token-in, token-out generation with log-probs.

Every request is token ids in and token ids out, so the sampled text is never re-tokenised.
Each result carries the behaviour log-prob of every generated token (after temperature)
and the weight version that produced it.

`load_weights` swaps in the trainer's weights without restarting the engine. With LoRA
(`lora_rank`), `load_adapter` swaps a policy's adapter instead and pauses nothing: requests in
flight finish on the adapter they started with, all their tokens at its version. The engine
serves several adapters at once (multi-LoRA), each a policy with its own version: a request
names its policy, and one adapter's update leaves the others' requests alone. With partial
rollout (the default) requests in flight are paused, kept, and resumed on the new weights
(their KV cache is recomputed), so the tokens of one request may carry two versions, split
at the token where the update happened. With `partial=False` every request in flight is
aborted at an update (finish_reason "abort"); the caller restarts the episode. Staleness is
bounded before a request starts, by admission control (see `Stream`), not here.

Each finished generation's text is split into reasoning, reply and tool calls by the
run's vLLM parsers (instar/rollout/parsers.py); its tokens stay as sampled. `stream` is
`generate` as a Ray streaming generator: the reply's text as it settles, then the same
Generation.

Images (vision-language models): a request carries data URLs, one per image placeholder in
its prompt, in order. vLLM expands each placeholder to one token per image patch group; the
result carries the prompt as expanded (`prompt_ids`), which is what the trainer must see. A
prompt may hold placeholders expanded by an earlier turn: runs of them are collapsed to one
before vLLM expands them again, identically.
"""

import asyncio
import os
import shutil
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path

from instar.processes import scratch_dir
from instar.rollout.versions import POLICY


@dataclass(frozen=True, slots=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    """The weight version that generated each token."""
    finish_reason: str
    """"stop", "length", "abort" (stopped at a weight update: restart the episode) or
    "behind" (the engine holds older weights than the caller's current version)."""
    text: str
    """The completion as sampled, special tokens included (the final stop token not)."""
    stop: str | None = None
    """The stop string that ended generation, if one did."""
    engine: int = 0
    """Which engine of the pool produced it."""
    routed_experts: list | None = None
    """MoE only, where the engine captures routing: [position][layer][top-k] expert ids for
    the prompt and the generated tokens (None elsewhere)."""
    prompt_ids: list[int] | None = None
    """Requests with images: the prompt with each image placeholder expanded as the model
    saw it (None for text-only requests, whose prompt is exactly what was sent)."""
    reasoning: str | None = None
    """`text`'s reasoning ("thinking"), as --model.reasoning-parser separated it; None: none.
    Its tokens are in `token_ids`, as sampled."""
    content: str | None = None
    """`text` without its reasoning and its parsed tool calls' markup: the reply (None: the
    text was not parsed; the reply is `text`). See instar/rollout/parsers.py."""
    tool_calls: list[dict] = field(default_factory=list)
    """Tool calls in `text` by --model.tool-parser, each `{"name": str, "arguments": dict}`."""
    tool_call_errors: int = 0
    """Tool calls `text` began that did not parse (for the parse-failure metric)."""


def collapse(ids: list[int], placeholder: int) -> list[int]:
    """Each run of `placeholder` tokens as one (an image expanded by an earlier turn)."""
    return [t for i, t in enumerate(ids) if t != placeholder or i == 0 or ids[i - 1] != placeholder]


class Engine:
    """Ray actor (create with `ray.remote(Engine)`); one per engine."""

    def __init__(self, model_path: str, *, dtype: str, max_model_len: int, kv_cache_gb: int,
                 threads: int, seed: int, engine_id: int = 0, partial: bool = True,
                 capture_routing: bool = False, tensor_parallel: int = 1,
                 gpu_memory_utilization: float = 0.9, transport: str = "file", nice: int = 0,
                 tool_parser: str = "", reasoning_parser: str = "", lora_rank: int = 0,
                 lora_targets: str | list[str] = "", lora_policies: int = 1):
        from instar.rollout.parsers import Parsers, check
        from instar.train.lora import engine_modules, engine_rank

        check(tool_parser, reasoning_parser)  # (before the model loads)
        for thread in os.listdir("/proc/self/task") if nice else ():  # (nice is per thread)
            os.setpriority(os.PRIO_PROCESS, int(thread), nice)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        # The model runs in the engine-core process: a separate worker process would busy-poll
        # shared memory for a second after each step, taking a core from the trainer on a CPU
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM's AOT compile cache fails to load with this torch ("'function' object has no
        # attribute 'finalize_loading'"), so every start compiled the model again (~10 s on a
        # CPU); its Inductor cache loads
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        if transport == "ipc":  # CUDA IPC handles cross into the engine process pickled
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if capture_routing:  # vLLM returns routed experts from its V2 runner only (GPU)
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        # Requests are seeded one by one (see router.py), each sampling with a generator of its
        # own; after a split prefill vLLM rewinds it, which a CPU generator cannot ("CPU
        # Generator does not use offset", the engine dies): on a CPU, no prompt is split
        cpu = current_platform.is_cpu()
        args = AsyncEngineArgs(
            enable_chunked_prefill=not cpu,
            max_num_batched_tokens=max(max_model_len, 2048) if cpu else None,
            model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
            logprobs_mode="processed_logprobs",  # after temperature: what sampled the token
            worker_extension_cls="instar.rollout.weight_receiver.WeightReceiver",
            enable_prefix_caching=True, enable_return_routed_experts=capture_routing,
            # tensor parallel: vLLM's workers are processes of this actor, on the GPUs Ray gave
            # it (CUDA_VISIBLE_DEVICES); its default in a placement group, "ray", would ask Ray
            # for GPUs of their own beside this actor's
            tensor_parallel_size=tensor_parallel,
            distributed_executor_backend="uni" if tensor_parallel == 1 else "mp",
            gpu_memory_utilization=gpu_memory_utilization,
            weight_transfer_config=None if transport == "file" else {"backend": transport},
            # LoRA: each policy's current adapter and the one its requests in flight still use
            enable_lora=bool(lora_rank), max_lora_rank=engine_rank(lora_rank or 1),
            max_loras=2 * lora_policies, max_cpu_loras=4 * lora_policies,
            lora_target_modules=engine_modules(model_path, lora_targets) if lora_rank else None)
        self.llm = AsyncLLM.from_engine_args(args)
        self.parsers = Parsers(self.llm.tokenizer, tool_parser, reasoning_parser)
        hf = self.llm.model_config.hf_config
        self.placeholders = {getattr(hf, k) for k in ("image_token_id", "video_token_id")
                             if hasattr(hf, k)}
        """A vision-language model's image/video placeholder ids: never valid as output."""
        self.version, self.engine_id = 0, engine_id
        import ray  # Ray restarted this engine after it died: its constructor runs again
        self.restarted = int(ray.get_runtime_context().was_current_actor_reconstructed)
        self.partial = partial
        self.live: dict[str, list[tuple[int, int]]] = {}
        """Requests in flight: id -> [(tokens generated before an update, the version after
        it), ...]."""
        self.window = dict(start=time.time(), tokens=0, prompt=0, cached=0, peak=0)
        self.finished_tokens = 0  # (for `progress`)
        self.ready = asyncio.Event()  # cleared while weights are being loaded
        self.ready.set()
        self.loras: dict[str, tuple[object, int]] = {}
        """LoRA: each policy's adapter (a vLLM LoRARequest) and its version."""
        self.lora_ids = 0
        self.adapters = scratch_dir()  # (LoRA: each version's adapter, as vLLM reads it)

    async def _outputs(self, prompt_ids: list[int], params, request_id: str | None = None,
                       images: list[str] = (), live: bool = False, lora=None):
        """vLLM's outputs of one request: the final one, or (`live`) each step's too, each
        holding all of the output so far."""
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from instar.agents.images import decode

        params.output_kind = RequestOutputKind.CUMULATIVE if live else RequestOutputKind.FINAL_ONLY
        params.flat_logprobs = True
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        if images:
            prompt = TokensPrompt(
                prompt_token_ids=collapse(prompt_ids, self.llm.model_config.hf_config.image_token_id),
                multi_modal_data={"image": [decode(u) for u in images]})
        async with aclosing(self.llm.generate(prompt, params, request_id=request_id or
                                              uuid.uuid4().hex, lora_request=lora)) as outputs:
            # (closed: aborted)
            async for out in outputs:
                yield out

    async def generate(self, prompt_ids: list[int], sampling: dict, current: int = 0,
                       images: list[str] = (), policy: str = POLICY) -> Generation:
        """`current`: the run's current version of `policy` (a restarted engine may not have
        it yet); `images`: data URLs, one per image placeholder in the prompt.

        finish_reason "placeholder": the model sampled an image placeholder token, which the
        next turn's engine and the trainer would take for an image slot: the episode fails."""
        return [g async for g in self._generate(prompt_ids, sampling, current, images, False,
                                                policy)][-1]

    async def stream(self, prompt_ids: list[int], sampling: dict, current: int = 0,
                     images: list[str] = (), policy: str = POLICY):
        """`generate` as a Ray streaming generator: the reply's text as it settles (str
        deltas: what `Parsers.settled` allows), then the Generation, as `generate` returns it."""
        async for item in self._generate(prompt_ids, sampling, current, images, True, policy):
            yield item

    async def _generate(self, prompt_ids: list[int], sampling: dict, current: int,
                        images: list[str], live: bool, policy: str):
        from vllm import SamplingParams

        await self.ready.wait()  # a request that arrives during an update waits for it
        lora, start = self.loras.get(policy, (None, self.version))
        if start < current:
            yield Generation([], [], [], "behind", "", engine=self.engine_id)
            return
        rid, updates, shown = uuid.uuid4().hex, [], ""
        self.live[rid] = updates
        self.window["peak"] = max(self.window["peak"], len(self.live))
        params = SamplingParams(**sampling, logprobs=0, skip_special_tokens=False)  # (markers kept)
        try:
            async with aclosing(self._outputs(prompt_ids, params, rid, images, live, lora)) as outputs:
                async for final in outputs:
                    settled = self.parsers.settled(final.outputs[0].text) if live else ""
                    if len(settled) > len(shown) and not final.finished:
                        yield settled[len(shown):]
                        shown = settled
        finally:
            del self.live[rid]
        o = final.outputs[0]
        versions, done = [], 0
        for n, version in updates:  # tokens before each update carry the version before it
            versions += [start] * (n - done)
            start, done = version, n
        versions += [start] * (len(o.token_ids) - done)
        w = self.window
        w["tokens"] += len(o.token_ids)
        self.finished_tokens += len(o.token_ids)
        w["prompt"] += len(prompt_ids)
        w["cached"] += final.num_cached_tokens or 0
        stop = o.stop_reason if isinstance(o.stop_reason, str) else None
        routing = getattr(o, "routed_experts", None)
        finish = "placeholder" if self.placeholders.intersection(o.token_ids) else o.finish_reason
        parsed = self.parsers.parse(o.text)
        yield Generation(list(o.token_ids), [s[t].logprob for t, s in zip(o.token_ids, o.logprobs)],
                         versions, finish, o.text, stop, self.engine_id,
                         None if routing is None else routing.tolist(),
                         list(final.prompt_token_ids) if images else None, parsed.reasoning,
                         parsed.content, parsed.tool_calls, parsed.tool_call_errors)

    async def prompt_logprobs(self, token_ids: list[int], policy: str = POLICY) -> list[float]:
        """Log-prob of each token given those before it (temperature 1; position 0 gets 0)."""
        from vllm import SamplingParams

        final = [o async for o in self._outputs(token_ids, SamplingParams(
            max_tokens=1, prompt_logprobs=0, temperature=1.0),
            lora=self.loras.get(policy, (None,))[0])][-1]
        return [0.0] + [step[tok].logprob for tok, step in
                        zip(token_ids[1:], final.prompt_logprobs[1:])]

    def _generated_so_far(self, rid: str) -> int | None:
        """Tokens the engine has returned for a request (exact once the engine is paused)."""
        out = self.llm.output_processor
        ids = out.external_req_ids.get(rid)
        return out.request_states[ids[0]].detokenizer.num_output_tokens() if ids else None

    def progress(self) -> tuple[int, int, bool]:
        """(requests in flight, tokens generated so far, loading weights): what the router's
        watchdog reads to tell a hung engine from an idle or busy one."""
        states = self.llm.output_processor.request_states.values()
        return (len(self.live), self.finished_tokens + sum(
            s.detokenizer.num_output_tokens() for s in states), not self.ready.is_set())

    async def pause(self, version: int) -> None:
        """Stop generating before weights `version` arrive (see the module docstring)."""
        self.ready.clear()
        await self.llm.pause_generation(mode="keep" if self.partial else "abort")
        for rid, updates in self.live.items():
            if (n := self._generated_so_far(rid)) is not None:
                updates.append((n, version))
        # (pausing also emptied the KV and prefix caches: nothing computed with the old
        # weights is reused)

    async def resume(self, version: int) -> None:
        self.version = version
        await self.llm.resume_generation()
        self.ready.set()

    async def load_weights(self, paths: list[str], version: int) -> None:
        """Pause, load `paths` (safetensors files; see WeightReceiver) as `version`, resume."""
        await self.pause(version)
        try:
            await self.llm.collective_rpc("load_safetensors", args=(paths,))
        finally:
            await self.resume(version)

    async def load_adapter(self, adapter: dict, version: int, policy: str = POLICY) -> None:
        """LoRA: serve `adapter` (instar/train/lora.py) as `version` of `policy` to its
        requests from now on; requests in flight keep theirs (see the module docstring)."""
        from vllm.lora.request import LoRARequest

        from instar.train import lora

        self.lora_ids += 1  # (vLLM tells adapters apart by id: a new one for each version)
        folder = lora.write(adapter, Path(self.adapters) / f"{self.lora_ids}-{policy}-v{version}")
        request = LoRARequest(folder.name, self.lora_ids, str(folder))
        await self.llm.add_lora(request)  # loaded now, not on the first request
        self.loras[policy] = request, version
        for old in Path(self.adapters).glob("[0-9]*"):  # vLLM keeps those it serves in memory
            if int(old.name.split("-")[0]) < self.lora_ids - 4 * len(self.loras):
                shutil.rmtree(old, ignore_errors=True)

    def incarnation(self) -> str:
        """This life of the engine (Ray restarts a dead one in a new worker process): a GPU
        transport's link is to one incarnation; the trainer links a new one again."""
        import ray

        return ray.get_runtime_context().get_worker_id()

    # GPU transports: vLLM's weight-transfer engine, driven from the trainer's side (see
    # Rank.connect in instar/train/rank.py); these four are the calls its Ray client makes.
    async def init_weight_transfer_engine(self, request) -> None:
        await self.llm.init_weight_transfer_engine(request)

    async def start_weight_update(self) -> None:
        await self.llm.start_weight_update()

    async def update_weights(self, request) -> None:
        await self.llm.update_weights(request)

    async def finish_weight_update(self) -> None:
        await self.llm.finish_weight_update()

    async def sleep(self) -> None:
        """Free the GPU memory of weights and KV cache while a colocated trainer trains."""
        await self.llm.sleep(level=1)

    async def wake_up(self) -> None:
        await self.llm.wake_up()

    def stats(self) -> dict[str, float]:
        """Whether Ray restarted this engine; since the last call: peak requests in flight,
        generated tokens/s, prefix-cache hit rate (prompt tokens served from the cache)."""
        w, now = self.window, time.time()
        self.window = dict(start=now, tokens=0, prompt=0, cached=0, peak=len(self.live))
        return {"restarted": self.restarted, "in_flight_peak": w["peak"], "tokens_per_s": w["tokens"] / (now - w["start"]),
                "prefix_cache_hit_rate": w["cached"] / max(w["prompt"], 1)}

    def shutdown(self) -> None:
        self.llm.shutdown()
        shutil.rmtree(self.adapters, ignore_errors=True)


ENGINE_RESTARTS = 3
"""Times Ray restarts an engine that died (see `Router`)."""


CPU_NICE = 10
"""On a CPU, engines run at this lower priority: the trainer's step is the critical path,
and the engines have until it ends to generate the next step's episodes on the same cores."""


def launch(model_path: str, *, device: str, dtype: str, max_model_len: int, kv_cache_gb: int,
           threads: int, seed: int, count: int = 1, placement: list[dict] | None = None,
           tensor_parallel: int = 1, **options) -> list:
    """Start `count` Engines as Ray actors (Ray must be initialised); returns once they are
    up, so start-up time never counts against an episode's timeout. `placement`: Ray
    options per engine (see instar.placement; default: `tensor_parallel` GPUs each, or none
    on a CPU); `options` go to Engine. Ray restarts an engine that dies (up to
    ENGINE_RESTARTS times); see `Router`."""
    import ray

    from instar.placement import check_engine_gpus

    if device == "cuda" and tensor_parallel > 1 and not placement:
        check_engine_gpus(tensor_parallel, ray.nodes())
    actor = ray.remote(max_restarts=ENGINE_RESTARTS)(Engine)
    default = dict(num_cpus=0, num_gpus=tensor_parallel if device == "cuda" else 0)
    engines = [actor.options(**(placement[i] if placement else default)).remote(
                   model_path, dtype=dtype, max_model_len=max_model_len, kv_cache_gb=kv_cache_gb,
                   threads=threads, seed=seed + i, engine_id=i, nice=CPU_NICE * (device != "cuda"),
                   tensor_parallel=tensor_parallel, **options)
               for i in range(count)]
    ray.get([e.__ray_ready__.remote() for e in engines])
    return engines


def stop_engines(engines: list) -> None:
    """Shut each engine's vLLM down, then end its actor (and process), even if that fails."""
    import ray

    try:
        ray.get([e.shutdown.remote() for e in engines], timeout=60)
    finally:
        for e in engines:
            ray.kill(e, no_restart=True)
