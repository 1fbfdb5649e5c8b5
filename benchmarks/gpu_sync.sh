#!/usr/bin/env bash
# GPU check of the weight-sync transports, one command, a few minutes:
#
#   bash benchmarks/gpu_sync.sh        # needs vllm (CUDA build) and ray: pip install -e .[gpu]
#
# Short RL runs of the small built-in model (about 24M params, float32) on the GPU, one per
# transport: ipc (engine and trainer colocated on one GPU; the engine sleeps while the
# trainer trains), nccl (engine on a second GPU, when there is one) and file (shared memory,
# the CPU path, as the baseline). Each prints its median sync time per step and the largest
# difference between the engine's and the trainer's log-probs of the probe sequence after a
# sync (the run stops if it exceeds --rollout.sync-check-tol), and the median engine-vs-trainer
# difference on the sampled tokens. Then two runs of the small MoE model: the engine captures
# each token's experts and the trainer replays them (moe-replay), or routes by itself (moe-own).
# Not yet run: no session so far had a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import vllm, ray" || { echo "needs vllm (CUDA build) and ray" >&2; exit 2; }
out=$(mktemp -d)
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")

run() {  # name, extra flags
  python3 -m instar.cli rl --model.size small --cluster.device cuda --train.num-ranks 1 \
    --train.steps 6 --train.warmup-sft-steps 0 --eval.size 0 --checkpoint.no-save-final \
    --logging.no-progress --rollout.sync-check-tol 1e-3 --rollout.max-staleness 0 \
    --logging.root "$out" \
    --logging.name "$1" "${@:2}" > "$out/$1.log" 2>&1 || { tail -30 "$out/$1.log"; exit 1; }
  python3 - "$out/$1/metrics.jsonl" "$1" <<'PY'
import json, statistics, sys
steps = [json.loads(line) for line in open(sys.argv[1])][1:]  # the first step warms up
print(f"{sys.argv[2]:5s} sync {statistics.median(s['timing/sync_s'] for s in steps):.3f} s/step, "
      f"train {statistics.median(s['timing/train_s'] for s in steps):.3f} s/step, "
      f"max probe |dlogp| {max(s['invariants/sync_probe_diff'] for s in steps):.2e}, "
      f"sampled-token |dlogp| {statistics.median(s['invariants/abs_logprob_diff'] for s in steps):.2e}")
PY
}

run ipc --rollout.transport ipc --rollout.placement colocated --rollout.gpu-memory 0.3
if [ "$gpus" -ge 2 ]; then
  run nccl --rollout.transport nccl --rollout.placement disaggregated --rollout.gpu-memory 0.5
else
  echo "nccl  skipped: needs a second GPU for the engine ($gpus found)"
fi
run file --rollout.transport file --rollout.placement colocated --rollout.gpu-memory 0.3
# MoE: the engine captures each token's experts and the trainer replays them; without replay
# the trainer routes by itself, and its log-probs of the sampled tokens drift further
run moe-replay --model.kind moe --rollout.transport ipc --rollout.gpu-memory 0.3
run moe-own --model.kind moe --rollout.transport ipc --rollout.gpu-memory 0.3 \
  --train.no-routing-replay
