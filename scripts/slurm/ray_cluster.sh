# shellcheck shell=bash
# Sourced by single_node.sbatch and multi_node.sbatch (submit those, not this file):
#   1. start a Ray head on the job's first node and a Ray worker on each other node;
#   2. wait until Ray reports every node and all their GPUs;
#   3. run `instar rl --config "$RECIPE" --cluster.ray-address HEAD:PORT` on the first node,
#      with the arguments given to sbatch after the script's name (they override the recipe),
#      in the run directory $INSTAR_RUN_NAME (default JOBNAME-JOBID) with
#      `--checkpoint.resume auto`: a requeued job (same id) continues from its last checkpoint;
#   4. on SIGTERM (preemption, scancel, or --signal=B:TERM before the time limit): pass it on
#      to instar, which finishes its step, checkpoints and exits; then, as on any exit or
#      failure, `ray stop` on every node and end the background steps. The job exits with
#      instar's status.
#
# Knobs (environment variables; sbatch passes the submitting shell's environment on):
#   RECIPE            recipe YAML, relative to the submit directory (required)
#   GPUS_PER_NODE     GPUs each node gives Ray (default: sbatch's --gpus-per-node, else 8)
#   RAY_PORT          port of the Ray head (GCS) on the first node (default 6379)
#   RAY_WAIT_S        seconds to wait for all nodes to join before giving up (default 300)
#   ENGINE_NODES      k > 0: the last k nodes run the engines, the others the trainer ranks
#                     (Ray resources `engine` and `trainer`, disaggregated placement; default 0:
#                     Ray packs engines and ranks onto the nodes as they fit)
#   CONTAINER_IMAGE   run every step in this image through pyxis (srun --container-image)
#   CONTAINER_MOUNTS  pyxis mounts (default: the submit directory, at the same path)
#   INSTAR_RUN_NAME   the run directory's name (--logging.name); give a finished job's name to
#                     a new job to continue that run from its last checkpoint
# Every srun option is written --name=value.
set -euo pipefail

: "${RECIPE:?set RECIPE to a recipe file, e.g. RECIPE=recipes/qwen3_4b_math_1node.yaml}"
gpus=${SLURM_GPUS_PER_NODE:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-${gpus##*:}}  # --gpus-per-node=h100:8 gives "h100:8"
RAY_PORT=${RAY_PORT:-6379}
RAY_WAIT_S=${RAY_WAIT_S:-300}
ENGINE_NODES=${ENGINE_NODES:-0}
# Ray 2.60 turns token authentication on for a head that finds a token, but not for the
# nodes that join it: decide once, for every step.
if [ -z "${RAY_AUTH_MODE:-}" ]; then
    if [ -n "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ] || [ -f "$HOME/.ray/auth_token" ]; then
        export RAY_AUTH_MODE=token
    else
        export RAY_AUTH_MODE=disabled
    fi
fi

hostnames=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
mapfile -t nodes <<<"$hostnames"
head=${nodes[0]}

marks=()      # per node: the `ray start` flag that marks it for engines or for trainer ranks
placement=()  # the matching instar flags
if ((ENGINE_NODES > 0)); then
    if ((ENGINE_NODES >= ${#nodes[@]})); then
        echo "instar: ENGINE_NODES=$ENGINE_NODES leaves none of the ${#nodes[@]} node(s) for" \
            "the trainer ranks" >&2
        exit 1
    fi
    for i in "${!nodes[@]}"; do
        role=trainer
        ((i < ${#nodes[@]} - ENGINE_NODES)) || role=engine
        printf -v "marks[i]" -- '--resources={"%s": %s}' "$role" "$GPUS_PER_NODE"
    done
    placement=(--rollout.placement disaggregated --cluster.engine-resource engine
               --cluster.trainer-resource trainer)
fi

# One task on one node, with all of the node's CPUs; --overlap lets steps share the node's
# CPUs and GPUs with the long-running `ray start` step.
step=(--nodes=1 --ntasks=1 --overlap --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}")
if [ -n "${CONTAINER_IMAGE:-}" ]; then
    step+=(--container-image="$CONTAINER_IMAGE" --container-name=instar
           --container-mounts="${CONTAINER_MOUNTS:-$PWD:$PWD}" --container-workdir="$PWD")
fi
on() {  # on NODE COMMAND...: run COMMAND as a job step on NODE
    srun "${step[@]}" --nodelist="$1" "${@:2}"
}
background=()
start() {  # start NODE COMMAND...: the same in the background, ended by the clean-up
    srun "${step[@]}" --nodelist="$1" "${@:2}" &
    background+=("$!")
}

cleanup() {
    local status=$? stops=() node
    trap - EXIT INT TERM
    echo "instar: stopping Ray on ${nodes[*]} (exit status $status)" >&2
    for node in "${nodes[@]}"; do
        on "$node" ray stop >&2 &
        stops+=("$!")
    done
    wait "${stops[@]}" || true
    kill "${background[@]}" 2>/dev/null || true
    wait || true
    exit "$status"
}
instar_step=""
preempted() {  # instar checkpoints at the end of its step on SIGTERM (srun passes it on)
    if [ -n "$instar_step" ]; then
        echo "instar: SIGTERM: instar checkpoints at the end of its step, then exits" >&2
        kill -TERM "$instar_step" 2>/dev/null || true
        wait "$instar_step" || true
    fi
    exit 143
}
trap cleanup EXIT
trap preempted TERM
trap 'exit 130' INT

wait_for_nodes() {  # wait_for_nodes N: until `ray status` lists N nodes and N * GPUS_PER_NODE GPUs
    local want=$1 deadline=$((SECONDS + RAY_WAIT_S)) status
    while :; do
        status=$(on "$head" ray status --address="$address" 2>&1) || true
        if [ "$(grep -cE '^ +[0-9]+ node_' <<<"$status")" -ge "$want" ] &&
            grep -q "/$((want * GPUS_PER_NODE))\.0 GPU" <<<"$status"; then
            return 0
        fi
        if ((SECONDS >= deadline)); then
            echo "instar: Ray did not reach $want node(s) with $GPUS_PER_NODE GPUs each" \
                "within RAY_WAIT_S=${RAY_WAIT_S}s; last \`ray status\`:" >&2
            echo "$status" >&2
            return 1
        fi
        sleep 5
    done
}

head_ip=$(on "$head" hostname --ip-address)
head_ip=${head_ip%% *}  # the first address where the node has several
address=$head_ip:$RAY_PORT
echo "instar: Ray head on $head ($address); nodes: ${nodes[*]}" >&2

start "$head" ray start --head --node-ip-address="$head_ip" --port="$RAY_PORT" \
    --num-gpus="$GPUS_PER_NODE" ${marks[0]:+"${marks[0]}"} --block
wait_for_nodes 1
for ((i = 1; i < ${#nodes[@]}; i++)); do
    start "${nodes[i]}" ray start --address="$address" --num-gpus="$GPUS_PER_NODE" \
        ${marks[i]:+"${marks[i]}"} --block
done
wait_for_nodes "${#nodes[@]}"

run_name=${INSTAR_RUN_NAME:-${SLURM_JOB_NAME:-instar}-${SLURM_JOB_ID:-0}}
start "$head" instar rl --config "$RECIPE" --cluster.ray-address "$address" \
    --logging.name "$run_name" --checkpoint.resume auto "${placement[@]}" "$@"
instar_step=$!
wait "$instar_step"  # in the background so that a TERM is handled at once
