#!/usr/bin/env bash
# On-policy distillation on the built-in reverse task (docs/scenarios.md §6).
#
# Teacher: the reverse job's model (`instar rl --data.task reverse`: the tiny built-in model
# after the supervised warm-up and 150 GRPO steps; held-out reward ~0.6). Student: a tiny
# model of another seed after the same short warm-up (60 steps, held-out ~0.27); both share
# the built-in tokenizer. The student samples; the teacher scores every sampled token; the
# advantage of a token is log p_teacher - log p_student (minus the per-token reverse KL), so
# the task's reward is logged but not used.
# `train/teacher_kl` in metrics.jsonl is the reverse KL on the student's tokens, per step.
#
#     bash examples/distill_reverse.sh [RUNS_DIR]
set -euo pipefail
runs=${1:-runs}

# 1. The teacher: the reverse job, exported to $runs/distill-teacher/final.
instar rl --data.task reverse --logging.root "$runs" --logging.name distill-teacher

# 2. The student learns from the teacher on its own samples (benchmarks/scenarios.py distill:
#    teacher KL 2.97 -> 1.00, held-out reward 0.27 -> 0.51).
instar rl --data.task reverse --model.seed 1 --algo.estimator on_policy_distill \
    --algo.teacher "$runs/distill-teacher/final" --train.steps 120 --train.lr 2e-3 \
    --logging.root "$runs" --logging.name distill-student

python - "$runs/distill-student/metrics.jsonl" <<'EOF'
import json, sys
kl = [m["train/teacher_kl"] for line in open(sys.argv[1])
      if "train/teacher_kl" in (m := json.loads(line))]
print(f"reverse KL to the teacher: {kl[0]:.3f} (step 1) -> {kl[-1]:.3f} (step {len(kl)})")
EOF
