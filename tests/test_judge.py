"""LLM-as-judge on the real stack. The judge is the tiny model taught to answer every rubric
with "Score: 7" (conftest's `teach`), so a reward of 0.7 shows the judge model answered;
the untaught tiny policy never writes that. Checks: the judge is called once per episode,
the reward is what `parse_score` makes of its verdict, and none of its tokens (prompt or
verdict) are in the samples."""

import random

import openai
import pytest
from conftest import instar, serve_model, step_lines, teach

from instar import ChatAgent, Result, parse_score
from instar.agents.chat import as_messages, prompt_ids
from instar.agents.loading import load_agent, load_tasks
from instar.rollout.runner import Rollouts
from instar.sample import read_jsonl

EXAMPLE = "examples/judge_env.py"
DATA = "examples/data/calculator.jsonl"
Judged = load_agent(EXAMPLE)


@pytest.fixture(scope="module")
def judge_model(tiny_model, tmp_path_factory):
    rng, lessons = random.Random(0), []
    for i in range(6):  # assorted questions and (mostly garbled) answers, always "Score: 7"
        answer = "".join(rng.choice("abc 0123456789<>|_.") for _ in range(rng.randint(0, 30)))
        rubric = Judged.rubric.format(question=f"What is {i}+{i * 7}?", label=i * 8, answer=answer)
        lessons.append([{"role": "user", "content": rubric},
                        {"role": "assistant", "content": "Score: 7"}])
    return teach(tiny_model, tmp_path_factory.mktemp("judge") / "model", lessons, None,
                 steps=100)


@pytest.fixture(scope="module")
def judge_engine(ray_session, judge_model):
    yield from serve_model(judge_model)


def test_parse_score():
    assert [parse_score(v) for v in ("Score: 7", "Score: 7/10", "yes", "No.", "12", "-3",
                                     "none", "")] == [0.7, 0.7, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert parse_score("4", scale=5) == 0.8


class JudgedChat(ChatAgent):
    """The ChatAgent path: one reply through the gateway, rated by `self.judge`."""

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        reply = await client.chat.completions.create(model=ctx.model, messages=[
            {"role": "user", "content": ctx.task.prompt}])
        question = Judged.rubric.format(question=ctx.task.prompt, label=ctx.task.label,
                                        answer=reply.choices[0].message.content)
        verdict = await self.judge.ask([{"role": "user", "content": question}], max_tokens=8)
        return Result(reward=parse_score(verdict), info={"verdict": verdict})


@pytest.mark.stack
@pytest.mark.parametrize("agent_cls", [Judged, JudgedChat])
def test_policy_judge(agent_cls, judge_engine, tokenizer):
    """`--agent.judge policy`: the judge is the policy's own engines (here the taught model
    is the policy)."""
    tasks = load_tasks(DATA)[:4]
    runner = Rollouts(agent_cls, {}, [judge_engine], tokenizer, model_name="judge",
                      max_model_len=512, limits={}, judge="policy")
    try:
        batch = runner.run(tasks, 2, {"temperature": 1.0, "max_tokens": 8}, "j")
    finally:
        runner.close()
    assert dict(batch.failed) == {} and len(batch.samples) == 8
    assert runner.judge.calls == 8
    verdicts = [s.info["verdict"] for s in batch.samples]
    assert all(s.reward == parse_score(v) for s, v in zip(batch.samples, verdicts))
    assert verdicts.count("Score: 7") >= 6, verdicts
    for s in batch.samples:  # the prompt, then only what the policy generated
        task = next(t for t in tasks if t.id == s.task_id)
        prompt = prompt_ids(tokenizer, as_messages(task.prompt), None)
        assert s.tokens[:len(prompt)] == prompt
        assert s.loss_mask == [False] * len(prompt) + [True] * (len(s.tokens) - len(prompt))


@pytest.mark.stack
def test_frozen_judge_through_instar_rl(judge_model, ray_session, tmp_path):
    """`--agent.judge DIR`: a frozen model on an engine of its own, wired by `instar rl`."""
    run = instar(tmp_path, "rl", "--agent", EXAMPLE, "--agent.judge", str(judge_model),
                 "--data.train", DATA, "--eval.size", "0",
                 "--train.steps", "1", "--train.warmup-sft-steps", "0",
                 "--data.prompts-per-step", "4", "--rollout.group-size", "2",
                 "--rollout.max-tokens", "8")
    (m,) = step_lines(run).values()
    assert m["rollout/failed"] == 0 and m["invariants/abs_logprob_diff"] < 1e-4
    samples = read_jsonl(run / "rollouts.jsonl")
    verdicts = [s.info["verdict"] for s in samples]
    assert samples and all(s.reward == parse_score(v) for s, v in zip(samples, verdicts))
    assert verdicts.count("Score: 7") >= len(samples) - 1, verdicts
    for s in samples:  # the policy's prompt and generation only
        n = s.loss_mask.index(True)
        assert not any(s.loss_mask[:n]) and all(s.loss_mask[n:])
