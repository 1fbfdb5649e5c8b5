"""Each request is seeded from the run seed, its rollout id and its index in the episode, so
an episode samples the same whichever engine or batch serves it (what an exact resume needs,
on fresh engines): vLLM's CPU engine gives a seeded request a generator of its own."""

import openai
import pytest

from instar import ChatAgent, Env, Result, Task
from instar.rollout.router import request_seed
from instar.rollout.runner import Rollouts

pytestmark = pytest.mark.stack

SAMPLING = {"temperature": 1.0, "max_tokens": 12}
TASK = Task(prompt="Tell me a story.", id="story")


class TwoTurns(Env):
    """Two model turns: the second request of an episode has index 1."""

    max_turns = 2

    async def reset(self, task):
        return task.prompt

    async def step(self, action):
        return Result(reward=0.0, observation="Go on.")


class TwoRequests(ChatAgent):
    """Two requests through the gateway; tasks whose data has a `seed` send it."""

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        messages = [{"role": "user", "content": ctx.task.prompt}]
        for _ in range(2):
            r = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                     seed=ctx.task.data.get("seed"))
            messages += [r.choices[0].message.model_dump(include={"role", "content"}),
                         {"role": "user", "content": "Go on."}]
        return Result(reward=0.0)


def run(agent_cls, engines, tokenizer, tasks, n=2, seed=3):
    """{(rollout id, segment): (tokens, log-probs)} of `n` episodes of each task, tagged t7."""
    runner = Rollouts(agent_cls, {}, engines, tokenizer, model_name="tiny", max_model_len=512,
                      limits={}, seed=seed)
    try:
        batch = runner.run(tasks, n, SAMPLING, "t7")
    finally:
        runner.close()
    assert not batch.failed and not batch.restarted
    return {(s.rollout_id, s.segment): (s.tokens, s.logprobs) for s in batch.samples}


def generated(sample):
    tokens, logprobs = sample
    return [t for t, lp in zip(tokens, logprobs) if lp is not None]


def test_request_seed_is_stable_and_63_bits():
    seeds = {request_seed(s, r, i) for s in (0, 1) for r in ("t1-a-0", "t1-a-1") for i in (0, 1)}
    assert len(seeds) == 8 and all(0 <= x < 1 << 63 for x in seeds)
    assert request_seed(0, "t1-a-0", 1) == request_seed(0, "t1-a-0", 1)


def test_an_env_group_samples_the_same_on_either_engine(engines, tokenizer):
    on_0, on_1 = (run(TwoTurns, [e], tokenizer, [TASK]) for e in engines)
    assert on_0 == on_1 and len(on_0) == 2  # tokens and log-probs, both turns
    first, second = on_0.values()
    assert generated(first) != generated(second)  # sample indices 0 and 1
    assert run(TwoTurns, engines[:1], tokenizer, [TASK], seed=4) != on_0  # the run seed counts


def test_an_env_group_samples_the_same_alone_and_in_a_crowd(engines, tokenizer):
    crowd = [Task(prompt=TASK.prompt, id=f"other{i}") for i in range(31)]
    alone = run(TwoTurns, engines[:1], tokenizer, [TASK])
    among = run(TwoTurns, engines[:1], tokenizer, crowd[:16] + [TASK] + crowd[16:])
    assert len(among) == 64 and {k: among[k] for k in alone} == alone
    assert among[("t7-other0-0", 0)] != alone[("t7-story-0", 0)]  # rollout ids seed it


def test_a_chat_agent_group_samples_the_same_on_either_engine(engines, tokenizer):
    on_0, on_1 = (run(TwoRequests, [e], tokenizer, [TASK]) for e in engines)
    assert on_0 == on_1 and len({r for r, _ in on_0}) == 2
    assert generated(on_0["t7-story-0", 0]) != generated(on_0["t7-story-1", 0])
    # a client's own seed wins: both rollouts of a task that sends one sample alike
    own = run(TwoRequests, engines[:1], tokenizer, [Task(prompt=TASK.prompt, id="own",
                                                         data={"seed": 11})])
    assert own["t7-own-0", 0] == own["t7-own-1", 0]


def test_seeded_prompts_past_the_token_budget_are_not_split_on_a_cpu(engines, tokenizer):
    """Prompts together longer than one engine step's token budget (2048): vLLM would split
    one (a chunked prefill) and then rewind its generator, which a CPU generator cannot: the
    engine died. The CPU engine does not split prompts, so all of them are answered."""
    tasks = [Task(prompt=f"Tell me story {i} about " + "a long road, " * 14, id=f"road{i}")
             for i in range(12)]  # (each its own prompt: no prefix cache hit shortens it)
    assert sum(len(tokenizer(t.prompt)["input_ids"]) for t in tasks) * 2 > 2048
    out = run(TwoTurns, engines[:1], tokenizer, tasks)
    assert len(out) == 24
