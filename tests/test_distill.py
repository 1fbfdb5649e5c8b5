"""On-policy distillation on the real CPU stack, run as docs/scenarios.md §6 runs it (with the
tiny model as teacher, to stay fast): `instar rl --train.steps 0` gives a built-in model the
supervised warm-up on the reverse task and exports it as the teacher; an untrained student
(another seed) then trains on its own samples against the teacher's per-token log-probs
(`--algo.estimator on_policy_distill`), and its reverse KL to the teacher falls."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.stack


def instar_rl(root, name: str, *flags: str):
    out = subprocess.run(
        [sys.executable, "-m", "instar.cli", "rl", *flags, "--eval.size", "0",
         "--logging.root", str(root), "--logging.name", name, "--logging.no-progress"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return root / name


def test_the_students_reverse_kl_to_the_teacher_falls(tmp_path):
    teacher = instar_rl(tmp_path, "teacher", "--train.warmup-sft-steps", "40",
                        "--train.steps", "0", "--rollout.preflight", "0") / "final"
    run = instar_rl(tmp_path, "student", "--model.seed", "1", "--algo.estimator",
                    "on_policy_distill", "--algo.teacher", str(teacher),
                    "--train.warmup-sft-steps", "0", "--train.steps", "12", "--train.lr", "1e-2",
                    "--data.prompts-per-step", "8", "--rollout.group-size", "4")
    metrics = [m for line in (run / "metrics.jsonl").read_text().splitlines()
               if "rollout/reward" in (m := json.loads(line))]
    kl = [m["train/teacher_kl"] for m in metrics]
    assert len(kl) == 12 and kl[0] > 3  # the untrained student's tokens are unlikely to the teacher
    assert sum(kl[-3:]) / 3 < 0.7 * sum(kl[:3]) / 3, kl
    assert all(m["invariants/sync_probe_diff"] < 1e-4 for m in metrics)
