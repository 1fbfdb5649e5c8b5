"""On-policy distillation on the real CPU stack, run as docs/scenarios.md §6 runs it (with the
tiny model as teacher, to stay fast): the teacher is a built-in model after the supervised
warm-up on the reverse task (here in this process, as conftest's `teach`); an untrained student
(another seed) then trains on its own samples against the teacher's per-token log-probs
(`--algo.estimator on_policy_distill`), and its reverse KL to the teacher falls. The mean of
the last 3 steps over the first 3 was 0.29 for student seed 1 (this test), 0.47, 0.14 and 0.20
for seeds 2, 3, 4 (2026-12-07); the test asks for below 0.7."""

import pytest
from conftest import instar, step_lines, teach

from instar.agents.loading import load_tasks
from instar.tasks.reverse_data import reverse_data
from instar.train.sft import label_rows

pytestmark = pytest.mark.stack


def test_the_students_reverse_kl_to_the_teacher_falls(tiny_model, ray_session, tmp_path):
    tasks = load_tasks(reverse_data()[0])[:2000]
    teacher = teach(tiny_model, tmp_path / "teacher", [r["messages"] for r in label_rows(tasks)],
                    None, steps=40, batch=64)  # the default job's warm-up, in this process
    run = instar(tmp_path, "rl", "--data.task", "reverse", "--model.seed", "1",
                 "--algo.estimator", "on_policy_distill",
                 "--algo.teacher", str(teacher), "--train.warmup-sft-steps", "0",
                 "--train.steps", "12", "--train.lr", "1e-2", "--data.prompts-per-step", "8",
                 "--rollout.group-size", "4", "--eval.size", "0")
    metrics = list(step_lines(run).values())
    kl = [m["train/teacher_kl"] for m in metrics]
    assert len(kl) == 12 and kl[0] > 3  # the untrained student's tokens are unlikely to the teacher
    assert sum(kl[-3:]) / 3 < 0.7 * sum(kl[:3]) / 3, kl
    assert all(m["invariants/sync_probe_diff"] < 1e-4 for m in metrics)
