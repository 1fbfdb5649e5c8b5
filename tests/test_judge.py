"""LLM-as-judge on the real stack. The `policy` judge is the tiny model taught to answer every
rubric with "Score: 7" (conftest's `teach`), so a reward of 0.7 shows the judge model
answered; the untaught tiny policy never writes that. Checks: the judge is called once per
episode, the reward is what `parse_score` makes of its verdict, and none of its tokens
(prompt or verdict) are in the samples. The frozen judge (an engine of its own) is the
scenario's, taught to grade the reverse task letter by letter: GRPO on its verdicts alone
raises the exact score it never sees."""

import random
from pathlib import Path

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
JUDGE = Path(__file__).parent / "data" / "judge"  # the judge scenario's, exam passed
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
def test_grpo_on_a_frozen_judges_verdicts_raises_the_score_it_never_sees(ray_session, tmp_path):
    """`--agent.judge DIR`: a frozen model on an engine of its own, wired by `instar rl`. The
    judge is the LLM-as-judge scenario's (tests/data/judge/README.md), grading the default job
    (the reverse task after its warm-up) through instar/tasks/reverse_judged.py: the reward is
    its verdicts alone, and the exact score, which it never sees, rises. Its mean over the last
    5 of 30 steps less the first 5's, for model and data seeds 0 (this test), 1 and 2:
    +0.089, +0.138, +0.090 (2026-12-07). A step's exact score strays about 0.03 from its
    trend, so a run that learnt nothing would pass the bar of +0.05 with p < 0.01."""
    run = instar(tmp_path, "rl", "--data.task", "reverse", "--agent",
                 "instar/tasks/reverse_judged.py", "--agent.judge", str(JUDGE), "--train.steps",
                 "30", "--eval.size", "0")
    metrics = list(step_lines(run).values())
    judged = [m["rollout/reward"] for m in metrics]
    exact = [m["rollout/info/exact"] for m in metrics]
    assert len(exact) == 30 and all(m["rollout/failed"] == 0 for m in metrics)
    assert max(abs(j - e) for j, e in zip(judged, exact)) < 0.01  # the judge is right
    assert sum(exact[-5:]) / 5 > sum(exact[:5]) / 5 + 0.05, exact
    assert "invariants/abs_logprob_diff" in metrics[0]  # step 1's tokens all have lag 0
    assert all(m.get("invariants/abs_logprob_diff", 0.0) < 1e-4 for m in metrics)
    samples = read_jsonl(run / "rollouts.jsonl")
    assert samples and all(set(s.info["verdict"].split()) <= {"yes", "no"} for s in samples)
    for s in samples:  # the policy's prompt and generation only, no judge tokens
        n = s.loss_mask.index(True)
        assert not any(s.loss_mask[:n]) and all(s.loss_mask[n:])
