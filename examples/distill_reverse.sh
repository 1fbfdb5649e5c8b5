#!/usr/bin/env bash
# On-policy distillation on the built-in reverse task (docs/scenarios.md §6).
#
# Teacher: the small built-in model (~24M parameters) after a supervised warm-up on the task.
# Student: the tiny built-in model (~0.4M) after the default short warm-up (60 steps, reward
# ~0.3); both share the built-in tokenizer. The student samples; the teacher scores every
# sampled token; the advantage of a token is log p_teacher - log p_student (minus the
# per-token reverse KL), so the task's reward is logged but not used.
# `train/teacher_kl` in metrics.jsonl is the reverse KL on the student's tokens, per step.
#
#     bash examples/distill_reverse.sh [RUNS_DIR]
set -euo pipefail
runs=${1:-runs}

# 1. The teacher: `--train.steps 0` runs only the warm-up (cached), the eval (the teacher's
#    held-out reward) and the export to $runs/distill-teacher/final.
instar rl --model.size small --train.warmup-sft-steps 150 --train.warmup-sft-lr 1e-3 \
    --train.steps 0 --logging.root "$runs" --logging.name distill-teacher

# 2. The student learns from the teacher on its own samples.
instar rl --algo.estimator on_policy_distill --algo.teacher "$runs/distill-teacher/final" \
    --train.steps 60 --logging.root "$runs" --logging.name distill-student

python - "$runs/distill-student/metrics.jsonl" <<'EOF'
import json, sys
kl = [m["train/teacher_kl"] for line in open(sys.argv[1])
      if "train/teacher_kl" in (m := json.loads(line))]
print(f"reverse KL to the teacher: {kl[0]:.3f} (step 1) -> {kl[-1]:.3f} (step {len(kl)})")
EOF
