"""Gateway overhead, each figure measured side by side in one run:
- added latency per turn and throughput with 64 concurrent sessions, against calling the
  engine directly (the tiny model);
- `chat_over_env_throughput`: episodes per second of a ChatAgent (the stock OpenAI SDK
  through the gateway) over those of an Env doing the same turns, both run by `Rollouts` as
  `instar rl` runs them, 256 sessions at once, on the small built-in model (and the tiny).

    .venv/bin/python benchmarks/gateway.py   # writes benchmarks/results/gateway.json

Direct vs gateway: every turn generates exactly TOKENS tokens (ignore_eos). ChatAgent vs
Env: a turn ends at one of STOP_IDS (an eighth of the vocabulary), and a turn that ends
otherwise ends the episode on both paths; requests are seeded by episode and turn, so both
paths sample the same tokens, and the generated tokens of each path are reported.
"""

import asyncio
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import openai
import ray
from transformers import AutoTokenizer

from instar import ChatAgent, Env, Result, Task
from instar.agents.chat import prompt_ids
from instar.gateway.server import Gateway
from instar.rollout.engine import launch, stop_engines
from instar.rollout.runner import Rollouts
from instar.tasks.tiny_model import builtin_model

TOKENS, TURNS, SESSIONS, REPEATS = 16, 4, 64, 3
SAMPLING = {"temperature": 1.0, "max_tokens": TOKENS, "ignore_eos": True}
STOP_IDS = list(range(0, 512, 8))


async def direct_episode(engine, tokenizer, i):
    messages = [{"role": "user", "content": f"Question {i}"}]
    for t in range(TURNS):
        gen = await engine.generate.remote(prompt_ids(tokenizer, messages, None), SAMPLING)
        messages += [{"role": "assistant", "content": gen.text},
                     {"role": "user", "content": f"next {t}"}]


clients = {}  # event loop -> its one client (a client's connections belong to one loop)


async def gateway_episode(gw, i):
    sid = gw.open_session(f"b{i}", "b", SAMPLING, TURNS, 4096)
    loop = asyncio.get_running_loop()
    if loop not in clients:
        clients[loop] = openai.AsyncOpenAI(base_url=gw.base, api_key=gw.api_key)
    client = clients[loop].with_options(base_url=gw.urls(sid)[0])
    messages = [{"role": "user", "content": f"Question {i}"}]
    for t in range(TURNS):
        reply = await client.chat.completions.create(model="tiny", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"next {t}"}]
    gw.close_session(sid)


def timed(make, n):
    async def go():
        start = time.perf_counter()
        await asyncio.gather(*(make(i) for i in range(n)))
        return time.perf_counter() - start
    return asyncio.run(go())


class Turns(Env):
    """TURNS model turns, each answered with a short user message."""

    max_turns, timeout_s = TURNS, 600.0

    async def reset(self, task):
        self.t = 0
        return task.prompt

    async def step(self, action):
        self.t += 1
        return Result(reward=0.0, observation=f"next {self.t}", terminated=self.t == TURNS)


local = threading.local()  # one client per agent thread (docs/agents.md, section 6)


class ChatTurns(ChatAgent):
    """The same turns through the stock OpenAI SDK and the gateway."""

    max_turns, timeout_s = TURNS, 600.0

    async def run(self, ctx):
        if not hasattr(local, "client"):
            local.client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        client = local.client.with_options(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        messages = [{"role": "user", "content": ctx.task.prompt}]
        for t in range(1, TURNS + 1):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            if reply.choices[0].finish_reason != "stop":  # (as the Env loop ends)
                break
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"next {t}"}]
        return Result(reward=0.0)


def chat_over_env(size: str, sessions: int = 256, group: int = 8) -> dict:
    """Episodes per second of ChatTurns over Turns on one engine, interleaved REPEATS times."""
    path = builtin_model("dense", size, 0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    (engine,) = launch(str(path), device="cpu", dtype="float32", max_model_len=1024,
                       kv_cache_gb=2, threads=1, seed=0)
    sampling = {"temperature": 1.0, "max_tokens": 48, "stop_token_ids": STOP_IDS}
    tasks = [Task(prompt=f"Question {i}: what comes next?", id=str(i))
             for i in range(sessions // group)]
    paths = {name: Rollouts(cls, {}, [engine], tokenizer, model_name=size, max_model_len=1024,
                            limits={}) for name, cls in (("env", Turns), ("chat", ChatTurns))}
    rates, tokens = {name: [] for name in paths}, {}
    for repeat in range(REPEATS + 1):  # the first round warms both paths up
        for name, rollouts in paths.items():
            start = time.perf_counter()
            batch = rollouts.run(tasks, group, sampling, f"r{repeat}")
            wall = time.perf_counter() - start
            assert not batch.failed and len(batch.samples) >= sessions, (name, batch.failed)
            tokens[name] = sum(sum(s.loss_mask) for s in batch.samples)
            if repeat:
                rates[name].append(sessions / wall)
    for rollouts in paths.values():
        rollouts.close()
    stop_engines([engine])
    env, chat = (statistics.median(rates[k]) for k in ("env", "chat"))
    return {"ratio": round(chat / env, 3), "episodes_per_s": {"env": round(env, 2),
                                                              "chat": round(chat, 2)},
            "runs_episodes_per_s": {k: [round(x, 2) for x in v] for k, v in rates.items()},
            "generated_tokens_last_run": tokens}


def main():
    path = builtin_model()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    (engine,) = launch(str(path), device="cpu", dtype="float32", max_model_len=1024,
                       kv_cache_gb=1, threads=1, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    gw = Gateway(lambda _, ids, s, images: engine.generate.remote(ids, s), tokenizer, model="tiny",
                 max_model_len=1024).start()
    timed(lambda i: direct_episode(engine, tokenizer, i), 4)  # warm up both paths
    timed(lambda i: gateway_episode(gw, i), 4)
    lat_direct, lat_gw, tp_direct, tp_gw = [], [], [], []
    for _ in range(REPEATS):  # interleaved, so both paths see the same machine noise
        lat_direct.append(timed(lambda i: direct_episode(engine, tokenizer, i), 1) / TURNS)
        lat_gw.append(timed(lambda i: gateway_episode(gw, i), 1) / TURNS)
        tp_direct.append(SESSIONS * TURNS / timed(
            lambda i: direct_episode(engine, tokenizer, i), SESSIONS))
        tp_gw.append(SESSIONS * TURNS / timed(lambda i: gateway_episode(gw, i), SESSIONS))
    gw.stop()
    ray.get(engine.shutdown.remote())
    med = statistics.median
    small, tiny = chat_over_env("small"), chat_over_env("tiny")
    result = {
        "chat_over_env_throughput": small["ratio"],
        "chat_over_env_throughput_tiny": tiny["ratio"],
        "chat_over_env": {"small": small, "tiny": tiny, "setup": {
            "sessions": 256, "group_size": 8, "turns_per_episode": TURNS,
            "tokens_per_turn": "until one of 64 stop ids (mean 8), at most 48",
            "engine": "1 vLLM CPU engine, 1 thread",
            "chat_client": "openai.AsyncOpenAI, one per agent thread (with_options)",
            "both": "instar.rollout.runner.Rollouts, in this process; median of 3 runs"}},
        "added_latency_ms_per_turn": round(1000 * (med(lat_gw) - med(lat_direct)), 2),
        "throughput_ratio_vs_direct": round(med(tp_gw) / med(tp_direct), 3),
        "latency_ms_per_turn": {"direct": round(1000 * med(lat_direct), 2),
                                "gateway": round(1000 * med(lat_gw), 2)},
        "turns_per_s_64_sessions": {"direct": round(med(tp_direct), 1),
                                    "gateway": round(med(tp_gw), 1)},
        "setup": {"model": "built-in tiny dense (361K params)", "tokens_per_turn": TOKENS,
                  "turns_per_session": TURNS, "concurrent_sessions": SESSIONS,
                  "repeats": REPEATS, "client": "openai.AsyncOpenAI, non-streaming, one shared (with_options)",
                  "machine": f"{platform.machine()}, 2 cores, CPU only",
                  "date": time.strftime("%Y-%m-%d")},
    }
    out = Path(__file__).parent / "results" / "gateway.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
