"""Env episodes on the real engine: token identity across turns, limits, and failures."""

import asyncio

import pytest
import ray

from instar import Action, Env, Result, Task
from instar.agents.env_loop import run_env_episode
from instar.errors import EpisodeError

pytestmark = pytest.mark.stack

SAMPLING = {"temperature": 1.0, "max_tokens": 8}


class TwoTurns(Env):
    max_turns = 2
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]

    async def reset(self, task):
        self.actions = []
        return [{"role": "system", "content": "sys"}, {"role": "user", "content": task.prompt}]

    async def step(self, action: Action) -> Result:
        self.actions.append(action)
        if len(self.actions) == 1:
            return Result(reward=0.25, observation=[{"role": "tool", "content": "seen"}],
                          terminated=False)
        return Result(reward=0.5, info={"n": 2})


def episode(engine, tokenizer, env, sampling=SAMPLING):
    generate = lambda ids, s, images: engine.generate.remote(ids, s, 0, images)  # noqa: E731
    return asyncio.run(run_env_episode(env, Task(prompt="hi"), generate, tokenizer,
                                       sampling, "r", "g"))


def test_multi_turn_tokens_are_exactly_generated_plus_rendered_observations(engine, tokenizer):
    env = TwoTurns()
    # a bias on the end-of-turn token makes the random model end its turns early
    eos_bias = {**SAMPLING, "logit_bias": {tokenizer.eos_token_id: 20.0}}
    s = episode(engine, tokenizer, env, eos_bias)
    a1, a2 = env.actions
    assert a1.token_ids[-1] == tokenizer.eos_token_id
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        msgs, tools=TwoTurns.tools, tokenize=False, add_generation_prompt=True))
    obs = tokenizer.encode("\n<|im_start|>tool\n<tool_response>seen</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert s.tokens == prompt + a1.token_ids + obs + a2.token_ids
    assert s.loss_mask == [False] * len(prompt) + [True] * len(a1.token_ids) + \
        [False] * len(obs) + [True] * len(a2.token_ids)
    assert s.reward == 0.75 and s.info["turn_rewards"] == [0.25, 0.5] and s.info["n"] == 2


class Crashes(Env):
    async def reset(self, task):
        return task.prompt

    async def step(self, action):
        raise RuntimeError("boom")


class Hangs(Crashes):
    timeout_s = 0.5

    async def step(self, action):
        await asyncio.sleep(60)


def test_agent_errors_and_timeouts_cost_one_rollout(engine, tokenizer):
    with pytest.raises(EpisodeError, match="agent_error: RuntimeError: boom") as e:
        episode(engine, tokenizer, Crashes())
    assert e.value.reason == "agent_error"
    with pytest.raises(EpisodeError, match=r"over 0.5s; in the agent's step \(turn 1\)") as e:
        episode(engine, tokenizer, Hangs())
    assert e.value.reason == "timeout"
    gen = ray.get(engine.generate.remote([1, 2, 3], SAMPLING))  # the engine is still serving
    assert gen.token_ids


def test_turn_ending_without_end_of_turn_token_gets_one_before_the_observation(engine, tokenizer):
    env = TwoTurns()
    a = tokenizer.convert_tokens_to_ids("a")  # a stop token other than end-of-turn
    stop_at_a = {**SAMPLING, "stop_token_ids": [a], "logit_bias": {a: 20.0}}
    s = episode(engine, tokenizer, env, stop_at_a)
    a1, a2 = env.actions
    assert a1.token_ids[-1] == a != tokenizer.eos_token_id
    obs = tokenizer.encode("<|im_end|>\n<|im_start|>tool\n<tool_response>seen</tool_response>"
                           "<|im_end|>\n<|im_start|>assistant\n")
    assert s.tokens[-len(a2.token_ids) - len(obs):] == obs + a2.token_ids


def test_token_budget(engine, tokenizer):
    class Short(TwoTurns):
        max_tokens = 5  # shorter than the prompt
    with pytest.raises(EpisodeError) as e:
        episode(engine, tokenizer, Short())
    assert e.value.reason == "max_tokens"

    prompt_len = len(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
        tools=TwoTurns.tools, tokenize=False, add_generation_prompt=True)))

    class Budget(TwoTurns):
        max_tokens = prompt_len + 3
    s = episode(engine, tokenizer, Budget(), {**SAMPLING, "ignore_eos": True})  # never short
    assert s.num_generated == 3 and len(s.tokens) == prompt_len + 3
