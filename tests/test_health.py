"""Health gates (instar/health.py): the per-step rates, their thresholds, and episodes an agent
marks as lost to the infrastructure (InfraError), which leave their group instead of counting
as reward 0. No engine: the fake one of test_agent_isolation answers at once."""

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from instar import Env, InfraError, Result, Task
from instar.config import Config, HealthConfig
from instar.health import Health, HealthError, rates
from instar.metrics import StepResult, step_metrics
from instar.sample import Sample
from instar.train.advantages import sample_advantages
from tests.conftest import CALCULATOR, TOOL_CONVERSATION, instar, step_lines
from tests.test_agent_isolation import rollouts


def episode(i: int, reward: float = 1.0, group: str = "g", **info) -> Sample:
    return Sample(rollout_id=f"r{i}", group_id=group, segment=0, tokens=[1, 2, 3],
                  loss_mask=[False, True, True], logprobs=[None, -1.0, -1.0],
                  versions=[None, 0, 0], reward=reward, finish_reason="stop", info=info)


def test_tool_call_and_infrastructure_rates():
    eps = [episode(0, parsed_tool_calls=3, tool_call_errors=1),
           episode(1, parsed_tool_calls=0, tool_call_errors=2),
           episode(2, parsed_tool_calls=1, tool_call_errors=0)]
    assert rates(eps, Counter(infra=1, agent_error=1)) == pytest.approx({
        "rollout/tool_calls": 4 / 3, "rollout/tool_parse_failures": 3 / 7,
        "rollout/infra_errors": 1 / 5})
    none_begun = rates([episode(0, parsed_tool_calls=0, tool_call_errors=0)], Counter())
    assert "rollout/tool_parse_failures" not in none_begun  # (nothing to parse: no rate)
    assert none_begun["rollout/infra_errors"] == 0.0
    no_tools = rates([episode(0, tool_call_errors=1)], Counter())  # (a task without tools)
    assert set(no_tools) == {"rollout/infra_errors"}


def test_a_rate_warns_once_when_it_crosses_and_stops_the_run_past_its_stop_threshold():
    health = Health(HealthConfig(truncated=(0.5, 0.9), tool_calls=(1.0, 0.2)))
    assert health.check({"rollout/truncated": 0.4}, 1) == []
    first = health.check({"rollout/truncated": 0.6}, 2)
    assert len(first) == 1 and "--health.truncated" in first[0] and "60%" in first[0] \
        and "--rollout.max-tokens" in first[0]
    assert health.check({"rollout/truncated": 0.7}, 3) == []  # still over: said already
    health.check({"rollout/truncated": 0.1}, 4)
    assert len(health.check({"rollout/truncated": 0.8}, 5)) == 1  # over again after recovering
    assert "not using its tools" in health.check({"rollout/tool_calls": 0.5}, 6)[0]  # (low: bad)
    with pytest.raises(HealthError, match=re.escape("step 7") + ".*stop threshold 0.9, "
                       + re.escape("--health.truncated")):
        health.check({"rollout/truncated": 0.95}, 7)
    assert Health(HealthConfig()).check({"rollout/truncated": 1.0, "rollout/tool_calls": 0.0,
                                         "rollout/no_spread_groups": 1.0}, 1)  # (warns only)


@pytest.mark.parametrize("settings", [dict(truncated=(0.9, 0.5)), dict(tool_calls=(0.2, 1.0)),
                                      dict(infra_errors=(-0.1, 1.0))])
def test_thresholds_out_of_order_are_refused(settings):
    cfg = Config()
    cfg.health = HealthConfig(**settings)
    with pytest.raises(ValueError, match="--health.* takes two thresholds"):
        cfg.validate()


def test_an_infrastructure_failure_leaves_its_group_instead_of_counting_as_reward_zero(
        tokenizer):
    batch, _ = rollouts(InfraByTask, tokenizer, [Task(id="t", prompt="hi")], "infra", n=4)
    assert batch.failed == Counter(infra=1) and len(batch.samples) == 3
    assert "InfraError: the sandbox could not start" in batch.errors[0]["traceback"]
    m = step_metrics(StepResult(1, batch, batch.samples, {}, 0.0, [], {"wait": 0.0}))
    assert m["rollout/reward"] == 1.0 and m["rollout/infra_errors"] == 0.25
    assert m["rollout/no_spread_groups"] == 1.0  # the three that ran all solved it
    def advantages(samples):
        return sample_advantages(samples, Config().algo, {"logprobs": [
            [lp or 0.0 for lp in s.logprobs] for s in samples]}, None, 8)[0]
    assert all(a == 0.0 for ad in advantages(batch.samples) for a in ad)
    as_zero = batch.samples + [replace(batch.samples[0], rollout_id="lost", reward=0.0)]
    assert all(a > 0 for ad in advantages(as_zero)[:3] for a, m in zip(ad, as_zero[0].loss_mask)
               if m)  # (counted as reward 0, it would have pushed the others up)


class InfraByTask(Env):
    """Raises InfraError on its first episode (one instance per episode: a class counter)."""

    started = 0

    async def reset(self, task: Task):
        InfraByTask.started += 1
        self.first = InfraByTask.started == 1
        return task.prompt

    async def step(self, action) -> Result:
        if self.first:
            raise InfraError("the sandbox could not start")
        return Result(reward=1.0)


@pytest.mark.stack
def test_instar_rl_names_a_model_that_makes_no_tool_calls_before_step_1(ray_session, tmp_path,
                                                                       capsys):
    """The health preflight: the untrained tiny model never makes a tool call the parser
    reads, so with calls per episode required (stop below 0.5) the run ends before step 1,
    in one line that says why."""
    examples = Path(__file__).parents[1] / "examples"
    with pytest.raises(SystemExit) as stopped:
        instar(tmp_path, "rl", "--data.task", "reverse",
               "--agent", str(examples / "calculator_env.py"),
               "--data.train", str(examples / "data" / "calculator.jsonl"),
               "--train.warmup-sft-steps", "0", "--eval.size", "0", "--rollout.preflight", "4",
               "--health.tool-calls", "1", "0.5", "--train.steps", "1")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "health check failed at step 0" in err
    assert "--health.tool-calls" in err and "not using its tools" in err
    assert "Traceback" not in err
    assert not step_lines(tmp_path / "run")  # (no step ran)


@pytest.mark.stack
def test_a_warm_up_on_a_tool_demonstration_passes_the_same_gate(ray_session, tmp_path):
    """`--train.warmup-sft-data`: the same run, warmed up first on one multi-turn
    demonstration of a calculator call (with its tool) instead of the tasks' labels, calls
    the tool and trains."""
    examples = Path(__file__).parents[1] / "examples"
    demos = tmp_path / "demos.jsonl"
    demos.write_text(json.dumps({"messages": TOOL_CONVERSATION, "tools": [CALCULATOR]}) + "\n")
    run = instar(tmp_path, "rl", "--data.task", "reverse",
                 "--agent", str(examples / "calculator_env.py"),
                 "--data.train", str(examples / "data" / "calculator.jsonl"),
                 "--train.warmup-sft-data", str(demos), "--train.warmup-sft-steps", "250",
                 "--eval.size", "0", "--rollout.preflight", "4",
                 "--health.tool-calls", "1", "0.5", "--train.steps", "1",
                 "--rollout.temperature", "0.3", "--rollout.max-tokens", "40")  # (as the
    # examples' tests sample a taught model: room for the whole call, the taught path reliably)
    (step,) = step_lines(run).values()
    assert step["rollout/tool_calls"] >= 0.5, step
