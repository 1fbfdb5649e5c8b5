"""Gateway overhead: added latency per turn and throughput with 64 concurrent sessions,
each measured side by side against calling the engine directly, in one run.

    .venv/bin/python benchmarks/gateway.py   # writes benchmarks/results/gateway.json

Every turn generates exactly TOKENS tokens (ignore_eos), so both paths do the same engine work.
"""

import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

import openai
import ray
from transformers import AutoTokenizer

from instar.agents.chat import prompt_ids
from instar.gateway.server import Gateway
from instar.rollout.engine import launch
from instar.tasks.tiny_model import builtin_model

TOKENS, TURNS, SESSIONS, REPEATS = 16, 4, 64, 3
SAMPLING = {"temperature": 1.0, "max_tokens": TOKENS, "ignore_eos": True}


async def direct_episode(engine, tokenizer, i):
    messages = [{"role": "user", "content": f"Question {i}"}]
    for t in range(TURNS):
        gen = await engine.generate.remote(prompt_ids(tokenizer, messages, None), SAMPLING)
        messages += [{"role": "assistant", "content": gen.text},
                     {"role": "user", "content": f"next {t}"}]


async def gateway_episode(gw, i):
    sid = gw.open_session(f"b{i}", "b", SAMPLING, TURNS, 4096)
    client = openai.AsyncOpenAI(base_url=gw.urls(sid)[0], api_key=gw.api_key)
    messages = [{"role": "user", "content": f"Question {i}"}]
    for t in range(TURNS):
        reply = await client.chat.completions.create(model="tiny", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"next {t}"}]
    await client.close()
    gw.close_session(sid)


def timed(make, n):
    async def go():
        start = time.perf_counter()
        await asyncio.gather(*(make(i) for i in range(n)))
        return time.perf_counter() - start
    return asyncio.run(go())


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
    med = statistics.median
    result = {
        "added_latency_ms_per_turn": round(1000 * (med(lat_gw) - med(lat_direct)), 2),
        "throughput_ratio_vs_direct": round(med(tp_gw) / med(tp_direct), 3),
        "latency_ms_per_turn": {"direct": round(1000 * med(lat_direct), 2),
                                "gateway": round(1000 * med(lat_gw), 2)},
        "turns_per_s_64_sessions": {"direct": round(med(tp_direct), 1),
                                    "gateway": round(med(tp_gw), 1)},
        "setup": {"model": "built-in tiny dense (361K params)", "tokens_per_turn": TOKENS,
                  "turns_per_session": TURNS, "concurrent_sessions": SESSIONS,
                  "repeats": REPEATS, "client": "openai.AsyncOpenAI, non-streaming",
                  "machine": f"{platform.machine()}, 2 cores, CPU only",
                  "date": time.strftime("%Y-%m-%d")},
    }
    out = Path(__file__).parent / "results" / "gateway.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    gw.stop()
    ray.get(engine.shutdown.remote())


if __name__ == "__main__":
    main()
