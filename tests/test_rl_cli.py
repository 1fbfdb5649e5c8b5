"""`instar rl` run the way a user runs it, for a couple of steps; checks what it writes."""

import json
import subprocess
import sys

import yaml
from transformers import AutoModelForCausalLM

from instar.sample import read_jsonl


def test_instar_rl_end_to_end(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "instar.cli", "rl", "--train.steps", "2",
         "--train.warmup-sft-steps", "3", "--data.prompts-per-step", "4",
         "--rollout.group-size", "4", "--data.eval-size", "8", "--logging.root", str(tmp_path),
         "--logging.name", "run", "--logging.no-progress"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "run"
    assert "instar rl: summary" in out.stdout and "eval reward" in out.stdout
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 2
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # engine and trainer agree, also after the first weight sync
        assert m["invariants/abs_logprob_diff"] < 1e-4
        assert m["rollout/failed"] == 0
    samples = read_jsonl(run / "rollouts.jsonl")
    assert len(samples) == 4 and all(s.versions[-1] == 0 for s in samples)
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["eval_reward_after"] <= 1.0
    AutoModelForCausalLM.from_pretrained(run / "final")


def test_instar_rl_trains_a_chat_agent(tmp_path):
    data = "examples/data/calculator.jsonl"
    out = subprocess.run(
        [sys.executable, "-m", "instar.cli", "rl", "--agent", "examples/compacting_agent.py",
         "--data.train", data, "--data.eval", data, "--data.eval-size", "2",
         "--train.steps", "1", "--train.warmup-sft-steps", "0", "--data.prompts-per-step", "2",
         "--rollout.group-size", "2", "--rollout.max-tokens", "8",
         "--logging.root", str(tmp_path), "--logging.name", "run", "--logging.no-progress"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (m,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert m["rollout/failed"] == 0 and m["invariants/abs_logprob_diff"] < 1e-4
    assert m["rollout/info/turns"] == 3  # three model calls, in two segments
