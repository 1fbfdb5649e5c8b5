"""Exact resume, strictly on-policy: a run stopped after step 2
and resumed from its checkpoint learns exactly what the uninterrupted run learns: the same
losses, gradient norms, per-update statistics and critic losses at every step, and the same
final weights, with a critic (gae) and several updates per batch (2 epochs of 2 mini-batches,
the ratio against the old policy). What makes it exact: the checkpoint keeps the policy and
the critic with their optimizers, RNG and the stream's position; sampling is seeded per
request (so fresh engines sample alike); the mini-batch shuffle is seeded by the step.
(The overlapping schedule, where an update lands inside a partial rollout by timing, keeps
the same prompts: tests/test_async_loop.py.) Strictly on-policy here is
`--rollout.schedule sequential`, which keeps the staleness bound of 1 as given."""

import subprocess
import sys

import pytest
import yaml
from conftest import step_lines
from safetensors.torch import load_file

pytestmark = pytest.mark.stack

FLAGS = ["--data.task", "reverse", "--train.warmup-sft-steps", "0", "--data.prompts-per-step", "3",
         "--rollout.group-size", "2", "--rollout.max-tokens", "12", "--rollout.preflight", "0",
         "--eval.size", "0", "--logging.no-progress", "--logging.no-tensorboard",
         "--logging.no-plots", "--checkpoint.every", "2", "--checkpoint.keep", "1",
         "--rollout.schedule", "sequential", "--algo.estimator", "gae", "--algo.epochs", "2",
         "--algo.mini-batches", "2", "--algo.is-mode", "clip"]


def start(root, name, *flags) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "instar.cli", "rl", *FLAGS, *flags,
                             "--logging.root", str(root), "--logging.name", name],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]


def test_a_resumed_run_learns_exactly_what_the_uninterrupted_one_does(tmp_path):
    whole = start(tmp_path, "whole", "--train.steps", "4")
    half = start(tmp_path, "cut", "--train.steps", "2", "--checkpoint.no-save-final")
    finish(half)
    finish(start(tmp_path, "cut", "--train.steps", "4", "--checkpoint.resume", "auto"))
    finish(whole)

    a, b = step_lines(tmp_path / "whole"), step_lines(tmp_path / "cut")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    keys = ["prompts", "rollout/reward", "train/loss", "train/grad_norm", "train/critic_loss",
            "train/updates", "train/entropy", "train/approx_kl"]
    for step in (3, 4):  # the steps after the resume
        assert {k: b[step][k] for k in keys} == {k: a[step][k] for k in keys}, step
    assert len(a[4]["train/updates"]) == 4 and a[4]["train/approx_kl"] > 0  # it did move
    # sequential: every token on-policy, within the bound of 1 that config.yaml keeps as given
    rollout = yaml.safe_load((tmp_path / "whole" / "config.yaml").read_text())["rollout"]
    assert (rollout["schedule"], rollout["max_staleness"]) == ("sequential", 1)
    assert all(m["staleness/max"] == 0 for m in [*a.values(), *b.values()])
    final_a = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    final_b = load_file(tmp_path / "cut" / "final" / "model.safetensors")
    assert final_a.keys() == final_b.keys()
    assert all(final_a[k].equal(final_b[k]) for k in final_a)
