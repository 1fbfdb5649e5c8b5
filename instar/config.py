"""One typed config for every command. CLI flags are generated from it (tyro); `validate()` is
the one place that refuses unsafe combinations, and settings that would be silently ignored.

Each command reads some of the sections (instar/cli.py `SECTIONS`) and shows only those in
its --help; a setting has the same flag, and the same default, in every command:

    instar rl --rollout.group-size 8 --train.steps 40
    instar rollout --agent FILE --data.train FILE --rollout.max-tokens 64
    instar rl --config recipe.yaml --train.lr 1e-4     # flags override the recipe
    instar rl --print-config                           # the resolved config as YAML
"""

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import tyro
import yaml


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0))


SEQUENCES_PER_THREAD = 32
"""--rollout.schedule auto on a CPU: with fewer of a step's sequences per engine thread,
decoding is bound by vLLM's per-step work on one core, not by the model's compute, and the
cores it leaves idle are better spent training beside it (overlap). Measured on 2 cores
(benchmarks/schedule.py): 64 per thread (grpo-small, the default job) ran faster sequential,
8 (long: 16 sequences of 1024 tokens) faster overlapping."""


TASK_SETTINGS = {
    "tool_use": {"train.warmup_sft_steps": 425, "train.warmup_sft_batch": 16, "train.lr": 3e-4,
                 "train.steps": 60, "data.prompts_per_step": 8, "rollout.max_tokens": 80},
    "reverse": {"train.warmup_sft_steps": 60, "train.warmup_sft_batch": 64, "train.lr": 1e-3,
                "train.steps": 150, "data.prompts_per_step": 16, "rollout.max_tokens": 24}}
"""The defaults of each built-in task (--data.task) on the built-in model, which starts from
random weights: its supervised warm-up, then GRPO. Measured on 2 cores (docs/scenarios.md,
docs/benchmarks.md): `make run` shows the tool_use agent learning in 6½ minutes, reverse
learns in 2½. `instar sft` takes the reverse row (it does not run the task)."""
PRETRAINED_SETTINGS = {"train.warmup_sft_steps": 0, "train.warmup_sft_batch": 64, "train.lr": 1e-6,
                       "train.steps": 150, "data.prompts_per_step": 16, "rollout.max_tokens": 1024}
"""The defaults with --model.path: a pretrained model's RL settings, and no warm-up."""


def estimator_names() -> Any:
    """The choices of --algo.estimator: the registry `ESTIMATORS` (instar/train/advantages.py),
    read when the flags are parsed, not at import: `instar` and the --help of commands without
    --algo.* flags stay quick (no torch)."""
    from instar.train.advantages import ESTIMATORS

    return Literal[tuple(ESTIMATORS)]


ESTIMATOR_CHOICES = tyro.conf.arg(  # (the hint: tyro shows a factory's default as ['grpo'])
    constructor_factory=estimator_names,
    help_behavior_hint=lambda shown: "(default: {})".format(shown.strip("[]'")))


@dataclass
class ModelConfig:
    path: str = ""
    """A Hugging Face checkpoint: a folder, or a Hub id (org/name, through the huggingface_hub
    cache; docs/own_model.md). Empty: the built-in model chosen by kind/size/seed."""
    kind: Literal["dense", "moe", "vl"] = "dense"
    """Built-in model family (Qwen3 dense, Qwen3-MoE, or vl: a Qwen2-VL vision-language
    model, tiny only); used when `path` is empty."""
    size: Literal["tiny", "small"] = "tiny"
    """Built-in model size: tiny (<1M params, tests) or small (~25M, benchmarks)."""
    seed: int = 0
    """Seed of the built-in model's random initialisation."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the engines and the trainer, and the dtype of the weights the engines
    load (the trainer's own weights: --train.master-dtype)."""
    tool_parser: str = ""
    """vLLM tool-call parser for the model's replies (a name of vLLM's ToolParserManager, e.g.
    hermes, llama3_json, mistral). Empty: detected from the chat template."""
    reasoning_parser: str = ""
    """vLLM reasoning parser that separates "thinking" from the reply (a name of vLLM's
    ReasoningParserManager, e.g. qwen3, deepseek_r1). Empty: detected from the chat template."""


@dataclass
class DataConfig:
    train: str = ""
    """Training tasks: a .jsonl, .json or .parquet file, a `datasets` folder (save_to_disk) or
    a Hub dataset id (`org/name[:config]`, its train split); rows need the prompt column.
    Empty: the built-in task's data. See docs/own_model.md."""
    eval: str = ""
    """Held-out tasks for eval, in the same forms (a Hub dataset: its test, else validation
    split). Empty: the built-in task's held-out data."""
    task: Literal["tool_use", "reverse"] = "tool_use"
    """The built-in task: its data, agent and warm-up demonstrations are what a run takes where
    --data.train, --data.eval, --agent or --train.warmup-sft-data are not given, and with the
    built-in model its measured settings are the defaults (instar/config.py). tool_use: questions
    answered with lookup and calculator tools (instar/tasks/tool_use.py); reverse: reverse a
    string of letters in one reply (instar/tasks/reverse.py)."""
    prompt_key: str = "prompt"
    """Column of the task data that holds the prompt."""
    label_key: str = "label"
    """Column of the task data that holds the label (passed to the agent as `task.label`)."""
    prompts_per_step: int | None = None
    """Distinct tasks per training step (each is sampled `rollout.group_size` times); in
    `instar sft`, rows per step. Default: the built-in task's setting with the built-in model
    (tool_use: 8), else 16."""
    seed: int = 0
    """Seed for shuffling the training tasks."""


@dataclass
class AgentConfig:
    file: str = ""
    """Agent file: `path.py` (uses its `AgentRunner`) or `path.py:ClassName`; an Env or a
    ChatAgent. Empty: the built-in task. `--agent FILE` is short for `--agent.file FILE`."""
    config: dict[str, str] = field(default_factory=dict)
    """Keyword arguments for the agent's constructor (`--agent.config key value ...`)."""
    max_turns: int | None = None
    """Override the agent's `max_turns` (model turns per episode)."""
    max_tokens: int | None = None
    """Override the agent's `max_tokens` (tokens per episode, prompt and observations included)."""
    timeout_s: float | None = None
    """Override the agent's `timeout_s` (wall-clock seconds per episode; over it = failed)."""
    judge: str = ""
    """A judge model agents can ask (`self.judge`, docs/agents.md): "policy" (the policy's
    own engines, current weights) or a Hugging Face folder or Hub id (a frozen model on an
    engine of its own). Empty: none. Its generations are never trained on."""


@dataclass
class RolloutConfig:
    group_size: int = 8
    """Samples per task (`instar rollout` too); group baselines (grpo, rloo, ...) are computed
    within the group."""
    temperature: float = 1.0
    """Sampling temperature; the trainer applies the same one to its log-probs."""
    max_tokens: int | None = None
    """Most new tokens per model turn. Default: 24 for the built-in model, 1024 with
    --model.path."""
    ignore_eos: bool = False
    """Every model turn runs to `max_tokens`, past end-of-turn tokens (fixed-length responses,
    for benchmarks); what follows such a token is sampled and trained on like the rest."""
    max_model_len: int | None = None
    """Longest sequence (prompt and all turns) the engine accepts. Default: 1024 for the
    built-in model, 4096 with --model.path."""
    kv_cache_gb: int = 1
    """KV-cache size of a CPU engine, GiB."""
    num_engines: int = 1
    """vLLM engines (Ray actors); episodes are spread over them, one episode per engine. An
    engine that dies is restarted by Ray, given the current weights, and its episodes retried."""
    threads: int | None = None
    """CPU threads of each engine (on a CPU machine). Default: this machine's cores, shared
    among the engines (disaggregated: among engines and ranks)."""
    tensor_parallel: int = 1
    """GPUs of each engine (vLLM tensor parallelism; GPU only, disaggregated placement)."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: engines share devices (or cores) with the trainer ranks, and on GPUs sleep
    while it trains; disaggregated: engines and ranks each get their own."""
    gpu_memory: float = 0.5
    """Fraction of a GPU's memory an engine may take (vLLM gpu_memory_utilization); when
    colocated, leave room for the trainer."""
    transport: Literal["file", "nccl", "ipc"] = "file"
    """How weights reach the engines: file (each trainer rank's shards in shared memory,
    loaded by vLLM's reload_weights; CPU or GPU), nccl (GPU broadcast to engines on other
    devices), ipc (CUDA IPC to an engine on the same device: colocated)."""
    partial: bool = True
    """At a weight update, requests in flight are paused and resume on the new weights (each
    token records its version); False: they are aborted and their episodes restarted."""
    schedule: Literal["auto", "overlap", "sequential"] = "auto"
    """overlap: the next steps' episodes are generated while the trainer trains, up to
    `max_staleness` versions behind; sequential: generate, then train, each phase with all
    the compute (every token on-policy, which meets any max_staleness). auto, decided at
    start-up (logged, and in config.yaml): sequential where engines and ranks would contend
    for the same compute, that is colocated on GPUs, or colocated on a CPU with more threads
    than cores (the default threads) and at least 32 of a step's sequences per engine thread;
    else overlap."""
    max_staleness: int = 1
    """How many weight versions a generated token may lag the policy it is trained with.
    0: strictly on-policy (generate, then train: no overlap); k > 0: episodes for the next k
    steps are generated while the trainer trains (admission control starts no episode that
    could exceed the bound)."""
    on_failure: Literal["drop_rollout", "drop_group", "retry"] = "drop_rollout"
    """When an agent fails (raises, times out): drop that rollout, drop its whole group, or
    retry it with a fresh environment (`max_retries` times, then drop it)."""
    max_retries: int = 2
    """on_failure=retry: fresh attempts per rollout."""
    preflight: int = 16
    """Before step 1, generate this many samples and rescore them in the trainer; a mismatch
    above `preflight_tol` stops the run with a diagnosis (0: skip)."""
    preflight_tol: float | None = None
    """Largest mean |engine - trainer| log-prob allowed in the preflight. Default by
    --model.dtype: 1e-3 for float32, 3e-2 for bfloat16."""
    sync_check_tol: float | None = None
    """After each weight sync, the most the engine's and trainer's log-probs of a fixed probe
    sequence may differ before the run stops. Default by --model.dtype: 1e-4 for float32,
    5e-2 for bfloat16."""
    hang_s: float = 120.0
    """An engine with requests in flight that generates no token (or does not answer) for this
    long is taken for hung: killed, restarted by Ray with the current weights, and its
    episodes restarted (0: no watchdog)."""
    max_request_mb: float = 32.0
    """The gateway refuses larger request bodies (413)."""
    runners: int = 0
    """Agent runner processes (Ray actors, spread over the cluster's nodes; see
    docs/scale_out.md). Each runs its share of the episodes, and for ChatAgents a gateway on
    its own node's loopback. 0: the episodes run in the driver process."""


@dataclass
class AdapterConfig:
    """One adapter of a multi-LoRA run (an entry of `lora.adapters`, config file only)."""

    name: str = ""
    """Its name: PEFT's adapter name, the engines' policy, `lora/<name>/` in the metrics, and
    adapters/<name>/ in the run directory (its rollouts, checkpoints and final/)."""
    agent: str = ""
    """Its agent file (as --agent.file). Empty: --agent.file."""
    agent_config: dict[str, str] = field(default_factory=dict)
    """Keyword arguments for its agent (as --agent.config). Empty: --agent.config."""
    train: str = ""
    """Its training tasks (as --data.train). Empty: --data.train."""
    eval: str = ""
    """Its held-out tasks (as --data.eval). Empty: --data.eval."""
    lr: float = 0.0
    """Its optimizer's learning rate. 0: --train.lr."""
    max_staleness: int = -1
    """Its staleness bound (as --rollout.max-staleness). -1: --rollout.max-staleness."""


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA: train a rank-R adapter on every module --lora.targets matches, the base model
    frozen (PEFT on the FSDP2 ranks). Engines serve the base with the adapter (vLLM's LoRA),
    and a weight sync moves only the adapter. 0: train every weight."""
    alpha: float = 16.0
    """The adapter's scale is alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (the engines sample without it)."""
    targets: str = r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    """Regular expression for the names of the modules that get an adapter (PEFT's
    target_modules): by default every linear layer of the decoder."""
    merge: bool = False
    """Also export the base with the adapter merged in, as a Hugging Face folder (final/merged)."""
    path: str = ""
    """A trained adapter (a PEFT folder, such as a run's final/) for the engines of instar
    rollout, eval and serve to serve on --model.path."""
    adapters: tyro.conf.Suppress[list[AdapterConfig]] = field(default_factory=list)
    """Multi-LoRA (config file only): several adapters of --lora.rank, trained in one run
    against one base model and one engine pool, each with its own agent, data, optimizer,
    weight version, staleness bound and metrics. Empty: one adapter (with --lora.rank)."""


@dataclass
class EvalConfig:
    size: int = 64
    """Held-out tasks evaluated (`data.eval`); 0 turns eval off."""
    every: int = 0
    """Evaluate every this many steps, besides before and after training (0: only those)."""
    samples: int = 1
    """Samples per task; pass@k is reported for k = 1, 2, 4, ... up to this."""
    temperature: float = 1.0
    """Sampling temperature for eval (0: greedy)."""
    max_tokens: int = 0
    """Most new tokens per model turn in eval (0: `rollout.max_tokens`)."""
    pass_threshold: float = 1.0
    """A sample passes (for pass@k) when its reward is at least this."""


@dataclass
class TrainConfig:
    steps: int | None = None
    """RL steps (each: generate, score, one optimizer step, weight sync); SFT steps in
    `instar sft`. Default: the built-in task's setting with the built-in model (tool_use: 60),
    else 150."""
    num_ranks: int = 2
    """FSDP2 ranks, one Ray actor each."""
    freeze: list[str] = field(default_factory=list)
    """Regular expressions; parameters whose names match one are not trained (and never
    re-sent to the engines), e.g. 'mlp\\.gate\\.' for the MoE routers (Qwen3-MoE:
    model.layers.N.mlp.gate.weight)."""
    threads_per_rank: int | None = None
    """CPU threads of each rank's torch. Default: this machine's cores, shared among the
    ranks (disaggregated: among engines and ranks)."""
    lr: float | None = None
    """AdamW peak learning rate. Default: 1e-3 for the built-in model (a fresh tiny model),
    1e-6 with --model.path (a pretrained one)."""
    lr_warmup_steps: int = 0
    """Steps of linear warm-up from 0 to `lr`."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: keep `lr`, or decay it along a cosine to `min_lr_ratio * lr` at the end."""
    min_lr_ratio: float = 0.1
    """cosine: the final learning rate as a fraction of `lr`."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 turns clipping off)."""
    micro_batch_tokens: int = 8192
    """Most tokens (padding included) per forward/backward on each rank: sequences are sorted
    by length and packed into micro-batches up to this budget."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward (less memory, ~30% more
    compute)."""
    cpu_offload: bool = False
    """GPU only: keep parameters, gradients and optimizer states in CPU memory (FSDP2)."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trainer's parameters, gradient reduction and optimizer states; the forward
    and backward run in --model.dtype (bfloat16 compute with float32 masters keeps updates
    far smaller than a bfloat16 step, e.g. lr 1e-6, from rounding away)."""
    routing_replay: bool = True
    """MoE: each router of the policy's forward takes exactly the top-k experts the engine
    recorded for each token (GPU engines record them), with routing weights from the router's
    softmax at those experts, so the router still trains. No effect without recorded routing."""
    warmup_sft_steps: int | None = None
    """Supervised steps before RL on the training tasks' labels, or on demonstrations
    (--train.warmup-sft-data; the built-in tool_use task has its own); 0: none. The
    warmed-up model is cached, keyed by the base model, the rows and these settings. Default:
    the built-in task's setting for the built-in model, which starts from random weights
    (tool_use: 425), 0 with --model.path: nothing but RL trains your model unless you ask."""
    warmup_sft_lr: float = 3e-3
    """Learning rate of the supervised warm-up."""
    warmup_sft_batch: int | None = None
    """Tasks (or rows of --train.warmup-sft-data) per supervised warm-up step. Default: the
    built-in task's setting with the built-in model (tool_use: 16), else 64."""
    warmup_sft_data: str = ""
    """Chat JSONL for the warm-up to train on instead of the tasks' labels, as `instar sft`
    reads it: multi-turn demonstrations, with tool calls or images. Empty: the built-in
    task's demonstrations when it runs on its own data (tool_use has them), else the labels."""


@dataclass
class AlgoConfig:
    estimator: Annotated[str, ESTIMATOR_CHOICES] = "grpo"
    """Advantage estimator, one of `ESTIMATORS` (instar/train/advantages.py): gae trains a
    critic; on_policy_distill needs --algo.teacher and no reward."""
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    """PPO clip (per token), GSPO (sequence ratio) or CISPO (clipped weight times log-prob)."""
    aggregation: Literal["token", "sequence"] = "token"
    """Mean over all loss tokens of the step, or over sequences of their token means."""
    clip_low: float = 0.2
    """Ratio clip below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = 0.2
    """Ratio clip above 1 (ratio <= 1 + clip_high)."""
    dual_clip: float | None = None
    """PPO only: for negative advantages the loss is at most -dual_clip * A (> 1; None: off)."""
    is_mode: Literal["off", "mask", "clip", "truncate"] = "off"
    """Off-policy correction: weight the loss by old / behaviour probabilities (old: the
    trainer before the step's first update, which the PPO ratio is then against), with
    weights outside [is_low, is_high] zeroed (mask), clamped (clip) or capped (truncate).
    One update a step takes old from its own forward; several score it in one extra pass."""
    is_level: Literal["token", "sequence", "geometric"] = "token"
    """Importance weights per token, per sequence, or the per-token geometric mean."""
    is_low: float = 0.5
    """Lower edge of the importance-weight band."""
    is_high: float = 2.0
    """Upper edge of the importance-weight band."""
    kl_coef: float = 0.0
    """Weight of the KL to a reference model (0: no reference model is built)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator."""
    kl_in_reward: bool = False
    """Subtract the KL from the rewards instead of adding it to the loss."""
    reference: str = ""
    """Reference model for the KL (HF folder or Hub id). Empty: the starting policy."""
    teacher: str = ""
    """on_policy_distill: the teacher (HF folder or Hub id sharing the policy's tokenizer)."""
    gamma: float = 1.0
    """gae: discount per generated token."""
    lam: float = 1.0
    """gae: lambda."""
    critic_lr: float = 1e-3
    """gae: the critic's learning rate."""
    value_clip: float = 0.2
    """gae: clip of the critic's value change per step."""
    dynamic_filter: bool = False
    """Drop groups whose rewards are all equal (no learning signal) and draw more, in the
    run's task order, until the step holds --data.prompts-per-step informative groups or
    has drawn --algo.max-resample extra ones (DAPO's dynamic sampling)."""
    max_resample: int = 16
    """dynamic_filter: most groups a step draws beyond --data.prompts-per-step to replace
    dropped ones (0: drop without refilling)."""
    epochs: int = 1
    """Passes over each step's batch (PPO epochs)."""
    mini_batches: int = 1
    """Optimizer steps per pass: the batch is shuffled and split into this many parts."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus in the policy loss (the entropy is logged whatever this is)."""
    whiten: Literal["off", "batch", "group"] = "off"
    """Whiten the advantages (subtract the mean, divide by the std over loss tokens) over the
    whole batch or within each group."""
    reward_scale: float = 1.0
    """Multiply every reward (and per-turn reward) by this before the estimator."""
    reward_clip: float = 0.0
    """Clip every scaled reward into [-reward_clip, reward_clip] (0: off)."""
    kl_target: float = 0.0
    """Adaptive KL (Ziegler et al. 2019): steer --algo.kl-coef (its start) toward this KL per
    token (0: a fixed coefficient)."""
    kl_horizon: int = 10000
    """Adaptive KL: samples over which the coefficient moves by up to 20% per step's worth."""
    overlong_buffer: int = 0
    """Soft overlong penalty (DAPO): a reply within this many tokens of --rollout.max-tokens
    loses up to --algo.overlong-penalty of reward, linearly (0: off)."""
    overlong_penalty: float = 1.0
    """The penalty of a reply that reaches --rollout.max-tokens."""
    overlong_mask: bool = False
    """Leave truncated episodes (finish reason length or max_tokens) out of the loss; they
    still count in their group's baseline."""


@dataclass
class HealthConfig:
    """Per-step rates checked during `instar rl` (instar/health.py; docs/metrics.md): each
    takes two thresholds, the first warns and the second stops the run with a diagnosis."""

    tool_parse_failures: tuple[float, float] = (0.5, 1.0)
    """Share of the step's tool calls that did not parse: warn above the first, stop above the
    second (1: never). Also checked on the preflight's samples, before step 1."""
    tool_calls: tuple[float, float] = (0.0, 0.0)
    """Parsed tool calls per episode: warn below the first, stop below the second (0: never)."""
    infra_errors: tuple[float, float] = (0.1, 1.0)
    """Share of episodes lost to the infrastructure (an agent's InfraError: a sandbox or a tool
    service): warn above the first, stop above the second (1: never)."""
    no_spread_groups: tuple[float, float] = (0.9, 1.0)
    """Share of groups whose rollouts all got one reward: warn above, stop above."""
    truncated: tuple[float, float] = (0.5, 1.0)
    """Share of episodes that ran out of tokens: warn above, stop above."""


@dataclass
class CheckpointConfig:
    save_final: bool = True
    """Export the trained model as a Hugging Face folder `final/` in the run directory."""
    every: int = 0
    """Save a checkpoint (sharded model, optimizer, RNG, data position) every this many steps
    into the run directory's `checkpoints/` (0: never; a SIGTERM saves one whatever this is)."""
    keep: int = 2
    """Checkpoints kept (the newest)."""
    resume: str = ""
    """auto: continue from the newest checkpoint of the run directory (`--logging.name`), or
    start afresh if it has none (a requeued job passes it every time); empty: off."""


@dataclass
class LoggingConfig:
    root: str = "runs"
    """Folder that holds run directories."""
    name: str = ""
    """Run directory name. Empty: a timestamp."""
    progress: bool = True
    """Show a live progress display."""
    tensorboard: bool = True
    """Write TensorBoard event files to the run directory (`tensorboard --logdir runs`)."""
    wandb_project: str = ""
    """Also log to this Weights & Biases project (needs `pip install wandb`; empty: off)."""
    rollouts_every: int = 10
    """Write one group of samples to rollouts.jsonl every this many steps (and at step 1)."""
    plots: bool = True
    """At the end, draw PNG plots of the metrics into the run directory's plots/."""
    print_every: int = 10
    """When no live bar is shown (stdout not a terminal, e.g. a Slurm log, or --logging.no-
    progress), print a plain metrics line every this many steps (and at the first and last)."""
    bundle_every: int = 0
    """Write a replay bundle of every this many steps' update to bundles/ (its samples, config,
    RNG, weights before and after: `instar replay` recomputes it on a CPU). 0: off."""


@dataclass
class ClusterConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer and engines run: cpu (gloo) or cuda (nccl). auto: cuda if this
    machine sees a GPU, else cpu (joining a Ray cluster from a machine without GPUs: set it)."""
    ray_address: str = ""
    """Ray cluster to join: "auto" (the one `ray start` made on this machine, or RAY_ADDRESS)
    or HOST:PORT of its head. Empty: a Ray of this machine's own for the run."""
    engine_resource: str = ""
    """Custom Ray resource that marks the nodes for engines (`ray start --resources
    '{"NAME": N}'`); each engine takes one unit. Empty: any node. Needs disaggregated placement."""
    trainer_resource: str = ""
    """The same for trainer ranks: each takes one unit of it."""
    runner_resource: str = ""
    """The same for agent runners (--rollout.runners; each takes a thousandth of a unit, so
    one node can hold them all). Empty: spread over all nodes."""


@dataclass
class ServeConfig:
    sessions: int = 1
    """Sessions (episodes) to open, each with its own pair of base URLs."""


@dataclass
class Config:
    """A run's settings, in sections; each command reads some of them (instar/cli.py)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    @property
    def batch_size(self) -> int:
        """Rollouts per step."""
        return self.data.prompts_per_step * self.rollout.group_size

    def validate(self, rl: bool = True, trains: bool | None = None) -> "Config":
        """Fill in the defaults that depend on the model and task (`resolved_defaults`), then
        refuse out-of-range, contradictory or silently ignored settings; each message names the
        flag to change. `rl`: the settings are for RL training (a group needs two samples for a
        baseline; `instar rollout` and `instar eval` may take one); `trains`: the command trains
        (rl, sft; default: `rl`)."""
        trains = rl if trains is None else trains
        sft = trains and not rl
        defaults = self.resolved_defaults(sft)
        for name, value in defaults.items():
            section, key = name.split(".")
            if getattr(getattr(self, section), key) in (None, "auto"):
                setattr(getattr(self, section), key, value)
        self._check_ranges(rl)
        self._check_combinations()
        if self.lora.rank and not trains:
            raise ValueError("--lora.rank trains an adapter (instar rl, instar sft); to serve a "
                             "trained one here, give --lora.path DIR")
        if self.lora.adapters and not rl:
            raise ValueError("lora.adapters trains several adapters in instar rl; other "
                             "commands take one (--lora.rank R, or --lora.path DIR)")
        if self.lora.path and trains:
            raise ValueError("--lora.path serves a trained adapter (instar rollout, eval, "
                             "serve); training starts a new one: --lora.rank R")
        self._check_ignored(defaults, sft)
        return self

    def lanes(self) -> list[tuple[str, "Config"]]:
        """The policies the run trains: ("", self) for one; with `lora.adapters`, each
        adapter's name and config (this one with the adapter's agent, data, lr and bound)."""
        R = dataclasses.replace
        return [(a.name, R(self, agent=R(self.agent, file=a.agent or self.agent.file,
                                          config=a.agent_config or self.agent.config),
                           data=R(self.data, train=a.train or self.data.train,
                                  eval=a.eval or self.data.eval),
                           train=R(self.train, lr=a.lr or self.train.lr),
                           rollout=R(self.rollout, max_staleness=self.rollout.max_staleness
                                     if a.max_staleness < 0 else a.max_staleness)))
                for a in self.lora.adapters] or [("", self)]

    def resolved_defaults(self, sft: bool = False) -> dict[str, Any]:
        """The defaults that depend on the model, the task, its dtype and the devices: what a
        setting left unset (None, or --cluster.device auto) becomes. The built-in model is a
        fresh tiny one: it takes the built-in task's measured settings (TASK_SETTINGS; `sft`:
        for `instar sft`, which does not run the task); a pretrained model (--model.path) gets
        a pretrained model's RL settings."""
        bf16, device = self.model.dtype == "bfloat16", self.cluster.device
        settings = (PRETRAINED_SETTINGS if self.model.path else
                    TASK_SETTINGS["reverse" if sft else self.data.task])
        # threads: colocated engines and ranks take turns with every core (or share them, see
        # `schedule_for`); disaggregated ones divide them, each bundle reserving its own
        engines, ranks = self.rollout.num_engines, self.train.num_ranks
        if self.rollout.placement == "disaggregated":
            engines = ranks = engines + ranks
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return {"cluster.device": device, **settings,
                "rollout.max_model_len": 4096 if self.model.path else 1024,
                "rollout.threads": max(1, cores() // max(1, engines)),
                "train.threads_per_rank": max(1, cores() // max(1, ranks)),
                "rollout.preflight_tol": 3e-2 if bf16 else 1e-3,
                "rollout.sync_check_tol": 5e-2 if bf16 else 1e-4}

    def schedule_for(self, num_cores: int | None = None) -> tuple[str, str]:
        """What --rollout.schedule means on a machine of `num_cores` cores (default: this
        one's), and why: auto is sequential where engines and ranks would contend for the same
        compute, that is colocated on GPUs, or colocated on a CPU with more threads than cores
        and enough sequences a step to keep every engine thread busy (SEQUENCES_PER_THREAD)."""
        r, t = self.rollout, self.train
        if r.schedule != "auto":
            return r.schedule, "set by --rollout.schedule"
        if r.placement != "colocated":
            return "overlap", "engines and ranks have devices or cores of their own"
        if self.cluster.device == "cuda":
            return "sequential", "the engines share the ranks' GPUs"
        threads, n = r.num_engines * r.threads + t.num_ranks * t.threads_per_rank, num_cores or cores()
        if threads <= n:
            return "overlap", f"{threads} engine and rank threads fit in {n} cores"
        per_thread = self.batch_size / (r.num_engines * r.threads)
        if per_thread < SEQUENCES_PER_THREAD:  # decoding is bound by per-step overheads
            return "overlap", (f"{threads} threads share {n} cores, but {per_thread:g} sequences "
                               "per engine thread leave cores idle while generating")
        return "sequential", f"{threads} engine and rank threads share {n} cores"

    def _check_ranges(self, rl: bool) -> None:
        r, t, e, c, a = self.rollout, self.train, self.eval, self.checkpoint, self.algo
        if r.group_size < 1 or (rl and r.group_size < 2):
            raise ValueError("--rollout.group-size must be at least 2 for RL (GRPO's baseline "
                             "is the group mean, so a group of one has no learning signal); at "
                             "least 1 otherwise")
        if r.temperature <= 0 or e.temperature < 0:
            raise ValueError("--rollout.temperature must be > 0 (greedy decoding has no "
                             "behaviour log-probs to train with), --eval.temperature >= 0 (0: "
                             "greedy; eval trains on nothing)")
        if r.max_retries < 0 or r.preflight < 0 or r.runners < 0 or r.preflight_tol <= 0:
            raise ValueError("--rollout.max-retries, --rollout.preflight and --rollout.runners "
                             "must be >= 0, --rollout.preflight-tol > 0")
        if e.size < 0 or e.every < 0 or e.samples < 1 or e.max_tokens < 0:
            raise ValueError("--eval.size, --eval.every and --eval.max-tokens must be >= 0, "
                             "--eval.samples >= 1")
        if r.num_engines < 1 or self.serve.sessions < 1 or r.tensor_parallel < 1:
            raise ValueError("--rollout.num-engines, --rollout.tensor-parallel and "
                             "--serve.sessions must be >= 1")
        if r.max_staleness < 0 or not 0 < r.gpu_memory <= 1:
            raise ValueError("--rollout.max-staleness must be >= 0 and --rollout.gpu-memory in "
                             "(0, 1]")
        if r.threads < 1 or t.threads_per_rank < 1:
            raise ValueError("--rollout.threads and --train.threads-per-rank must be >= 1")
        if r.sync_check_tol <= 0:
            raise ValueError("--rollout.sync-check-tol must be > 0")
        if not 0 <= self.lora.rank <= 512 or not 0 <= self.lora.dropout < 1:
            raise ValueError("--lora.rank must be in [0, 512] (vLLM serves ranks up to 512) and "
                             "--lora.dropout in [0, 1)")
        if r.hang_s < 0 or r.max_request_mb <= 0:
            raise ValueError("--rollout.hang-s must be >= 0 (0: no watchdog) and "
                             "--rollout.max-request-mb > 0")
        if r.max_tokens >= r.max_model_len:
            raise ValueError(f"--rollout.max-tokens ({r.max_tokens}) must be smaller than "
                             f"--rollout.max-model-len ({r.max_model_len})")
        if t.num_ranks < 1 or t.micro_batch_tokens < 1 or t.steps < 0:
            raise ValueError("--train.num-ranks and --train.micro-batch-tokens must be >= 1, "
                             "--train.steps >= 0")
        if c.every < 0 or c.keep < 1 or self.logging.bundle_every < 0:
            raise ValueError("--checkpoint.every and --logging.bundle-every must be >= 0, "
                             "--checkpoint.keep >= 1")
        if c.resume not in ("", "auto"):
            raise ValueError(f"--checkpoint.resume takes auto (the newest checkpoint of the run "
                             f'directory, if any) or "" (off), not {c.resume!r}')
        for name, (warn, stop) in dataclasses.asdict(self.health).items():
            low = name == "tool_calls"  # (fewer is worse)
            if min(warn, stop) < 0 or (stop > warn if low else warn > stop):
                raise ValueError(f"--health.{name.replace('_', '-')} takes two thresholds >= 0, "
                                 f"the one that warns first (got {warn:g} {stop:g})")
        if self.data.prompts_per_step < 1:
            raise ValueError("--data.prompts-per-step must be >= 1")
        if a.dual_clip is not None and a.dual_clip <= 1:
            raise ValueError(f"--algo.dual-clip must be > 1 (got {a.dual_clip})")
        if not 0 <= a.is_low <= 1 <= a.is_high:
            raise ValueError("--algo.is-low and --algo.is-high must satisfy 0 <= low <= 1 <= high")
        if not 0 <= a.clip_low < 1 or a.clip_high < 0:
            raise ValueError("--algo.clip-low must be in [0, 1) and --algo.clip-high >= 0")
        if a.epochs < 1 or not 1 <= a.mini_batches <= self.data.prompts_per_step * r.group_size:
            raise ValueError("--algo.epochs must be >= 1 and --algo.mini-batches between 1 and "
                             "the step's samples (--data.prompts-per-step x --rollout.group-size)")
        if min(a.entropy_coef, a.reward_clip, a.kl_target, a.overlong_penalty, a.max_resample) < 0 \
                or a.reward_scale <= 0 or a.kl_horizon < 1:
            raise ValueError("--algo.entropy-coef, --algo.reward-clip, --algo.kl-target, "
                             "--algo.overlong-penalty and --algo.max-resample must be >= 0, "
                             "--algo.reward-scale > 0 and --algo.kl-horizon >= 1")
        if not 0 <= a.overlong_buffer <= r.max_tokens:
            raise ValueError(f"--algo.overlong-buffer must be in [0, --rollout.max-tokens "
                             f"({r.max_tokens})]")
        from instar.train.advantages import ESTIMATORS

        if a.estimator not in ESTIMATORS:
            raise ValueError(f"--algo.estimator {a.estimator!r} is unknown; known: "
                             f"{', '.join(ESTIMATORS)} (instar/train/advantages.py)")

    def _check_combinations(self) -> None:
        r, t, device = self.rollout, self.train, self.cluster.device
        if r.placement == "colocated" and device == "cuda" and r.schedule == "overlap":
            raise ValueError("colocated engines on GPUs sleep while the trainer trains, so "
                             "generation cannot overlap training: use --rollout.schedule "
                             "sequential (or auto), or --rollout.placement disaggregated")
        if r.transport != "file" and device != "cuda":
            raise ValueError(f"--rollout.transport {r.transport} needs GPUs (--cluster.device "
                             "cuda); on CPU use --rollout.transport file")
        if r.tensor_parallel > 1 and (device != "cuda" or r.placement != "disaggregated"):
            raise ValueError(f"--rollout.tensor-parallel {r.tensor_parallel} needs --cluster.device "
                             "cuda and --rollout.placement disaggregated: such an engine spans "
                             f"{r.tensor_parallel} GPUs of its own (a CPU engine runs on one "
                             "device; a colocated engine shares one GPU with a trainer rank)")
        if r.transport == "ipc" and r.placement != "colocated":
            raise ValueError("--rollout.transport ipc needs --rollout.placement colocated (CUDA "
                             "IPC shares a device); use nccl for disaggregated engines")
        if r.transport == "ipc" and r.num_engines > self.train.num_ranks:
            raise ValueError("--rollout.transport ipc needs an engine per trainer rank at most "
                             "(each engine opens the weights of the rank on its GPU): set "
                             "--rollout.num-engines <= --train.num-ranks")
        if r.transport == "nccl" and r.placement != "disaggregated":
            raise ValueError("--rollout.transport nccl needs --rollout.placement disaggregated "
                             "(NCCL refuses two ranks on one device); use ipc when colocated")
        if t.master_dtype == "bfloat16" and self.model.dtype == "float32":
            raise ValueError("--train.master-dtype bfloat16 needs --model.dtype bfloat16: master "
                             "weights are at least as precise as the compute")
        if self.checkpoint.resume and not self.logging.name:
            raise ValueError("--checkpoint.resume auto needs --logging.name: the run directory "
                             "whose checkpoints/ to continue from")
        if self.lora.rank and r.transport != "file":
            raise ValueError(f"--lora.rank trains an adapter, which reaches the engines through "
                             f"Ray's object store (megabytes, any node): leave out "
                             f"--rollout.transport {r.transport}")
        names = [a.name for a in self.lora.adapters]
        if names and not self.lora.rank:
            raise ValueError("lora.adapters trains several LoRA adapters of one rank: give "
                             "--lora.rank R too")
        if len(set(names)) < len(names) or not all(re.fullmatch(r"[A-Za-z]\w*", n) for n in names):
            raise ValueError(f"lora.adapters: each adapter needs a name of its own, of letters, "
                             f"digits and _, starting with a letter (got {names})")
        if any(a.lr < 0 or a.max_staleness < -1 for a in self.lora.adapters):
            raise ValueError("lora.adapters: lr must be >= 0 (0: --train.lr) and max_staleness "
                             ">= -1 (-1: --rollout.max-staleness)")
        if names and self.logging.bundle_every:
            raise ValueError("--logging.bundle-every records the step of one policy: with "
                             "lora.adapters it is not supported (0: off)")
        if names and self.algo.estimator == "gae":
            raise ValueError("--algo.estimator gae trains one critic, which several adapters "
                             "cannot share: with lora.adapters use a critic-free estimator")
        if self.algo.estimator == "on_policy_distill" and not self.algo.teacher:
            raise ValueError("--algo.estimator on_policy_distill needs --algo.teacher (an HF "
                             "folder sharing the policy's tokenizer)")

    def _check_ignored(self, defaults: dict[str, Any], sft: bool) -> None:
        """Settings changed from their `defaults` (resolved ones, else the field's) where
        nothing reads them (`sft`: in `instar sft`)."""

        def unused(*names: str, unless: str) -> None:
            """Refuse any of `names` ("section.field") that differs from its default."""
            for name in names:
                section_name, key = name.split(".")
                section = getattr(self, section_name)
                value = getattr(section, key)
                if value != defaults.get(name, getattr(type(section)(), key)):
                    flag = f"--{section_name}.{key.replace('_', '-')}"
                    shown = flag if isinstance(value, bool) else f"{flag} {value}"
                    raise ValueError(f"{shown} has no effect unless {unless}: set that, or "
                                     f"leave out {flag}")

        r, t, a, device = self.rollout, self.train, self.algo, self.cluster.device
        if a.policy_loss != "ppo":
            unused("algo.dual_clip", unless="--algo.policy-loss ppo (dual clip is PPO's)")
        if a.kl_coef == 0:
            unused("algo.kl_in_reward", "algo.kl_estimator", "algo.reference",
                   unless="--algo.kl-coef > 0 (0: no KL, no reference model)")
        if a.estimator != "on_policy_distill":
            unused("algo.teacher", unless="--algo.estimator on_policy_distill")
        if a.estimator != "gae":
            unused("algo.gamma", "algo.lam", "algo.critic_lr", "algo.value_clip",
                   unless="--algo.estimator gae (they are the critic's)")
        if not a.dynamic_filter:
            unused("algo.max_resample", unless="--algo.dynamic-filter")
        if a.kl_coef == 0 or a.kl_target == 0:
            unused("algo.kl_horizon", unless="--algo.kl-target > 0 (adaptive KL)")
        if a.kl_coef == 0:
            unused("algo.kl_target", unless="--algo.kl-coef > 0 (its starting value)")
        if a.overlong_buffer == 0:
            unused("algo.overlong_penalty", unless="--algo.overlong-buffer > 0")
        if a.is_mode == "off":
            unused("algo.is_level", "algo.is_low", "algo.is_high",
                   unless="--algo.is-mode mask, clip or truncate")
        if t.lr_schedule == "constant":
            unused("train.min_lr_ratio", unless="--train.lr-schedule cosine")
        if t.warmup_sft_steps == 0:
            unused("train.warmup_sft_lr", "train.warmup_sft_batch",
                   "train.warmup_sft_data", unless="--train.warmup-sft-steps > 0")
        if device != "cuda":
            unused("train.cpu_offload", "rollout.gpu_memory", unless="--cluster.device cuda")
        if device != "cpu":
            unused("rollout.kv_cache_gb", unless="--cluster.device cpu (a GPU engine's "
                   "KV cache is what --rollout.gpu-memory leaves)")
        if r.on_failure != "retry":
            unused("rollout.max_retries", unless="--rollout.on-failure retry")
        if r.preflight == 0:
            unused("rollout.preflight_tol", unless="--rollout.preflight > 0")
        if r.placement != "disaggregated":
            unused("cluster.engine_resource", "cluster.trainer_resource",
                   unless="--rollout.placement disaggregated (colocated engines and ranks "
                   "share bundles)")
        if self.lora.rank == 0:
            unused("lora.alpha", "lora.dropout", "lora.targets", "lora.merge",
                   unless="--lora.rank > 0 (they shape the adapter trained)")
        else:
            unused("train.freeze", unless="--lora.rank 0 (LoRA freezes the whole base)")
        if r.runners == 0:
            unused("cluster.runner_resource", unless="--rollout.runners > 0")
        if self.eval.size == 0:
            unused("data.eval", "eval.every", "eval.samples", "eval.temperature",
                   "eval.max_tokens", "eval.pass_threshold", unless="--eval.size > 0 "
                   "(0 turns eval off)")
        if self.checkpoint.every == 0:
            unused("checkpoint.keep", unless="--checkpoint.every > 0")
        if sft:
            unused("data.task", unless="instar rl, eval or rollout (instar sft trains on "
                   "--data.train, else on its own built-in conversations)")
        elif self.data.train and self.agent.file and self.model.path:
            unused("data.task", unless="--data.train, --agent or --model.path is left out (the "
                   "task fills it in)")
        if self.model.path:
            unused("model.kind", "model.size", "model.seed", unless="--model.path is "
                   "empty (they choose the built-in model)")

    def to_yaml(self) -> str:
        return yaml.safe_dump(dataclasses.asdict(self), sort_keys=False)


def _typed(key: str, kind, value):
    """`value` as a setting of type `kind`, or a ValueError that names `key`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Annotated:
        return _typed(key, args[0], value)
    if origin is types.UnionType:  # X | None
        return None if value is None else _typed(key, args[0], value)
    if origin is Literal and value in args:
        return value
    if origin is tuple and isinstance(value, list | tuple) and len(value) == len(args):
        return tuple(_typed(key, kind, v) for kind, v in zip(args, value))
    if origin is list and args and dataclasses.is_dataclass(args[0]) and isinstance(value, list):
        return [from_dict(args[0], v, f"{key}[{i}].") for i, v in enumerate(value)]
    if kind is float and not isinstance(value, bool):  # (YAML 1.1 reads 1e-6 as a string)
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    if kind in (int, str, bool) and type(value) is kind or origin in (list, dict) and \
            isinstance(value, origin):
        return value
    want = f"one of {list(args)}" if origin is Literal else getattr(kind, "__name__", str(kind))
    raise ValueError(f"{key}: expected {want}, got {value!r}")


def from_dict(cls, values: dict[str, Any], prefix: str = ""):
    """Build a (nested) config dataclass from a dict: unknown keys and values of the wrong type
    are refused, naming the key (e.g. `train.lr`)."""
    if not isinstance(values, dict):
        raise ValueError(f"{prefix[:-1] or 'the config'}: expected a mapping of settings, got "
                         f"{values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := sorted(set(values) - set(fields)):
        raise ValueError(f"unknown config key {prefix}{unknown[0]}; known here: {sorted(fields)}")
    kwargs = {}
    for name, value in values.items():
        kind, key = fields[name].type, prefix + name
        kwargs[name] = from_dict(kind, value, key + ".") if dataclasses.is_dataclass(kind) \
            else _typed(key, kind, value)
    return cls(**kwargs)


def load_yaml(path: str) -> Config:
    """A recipe; errors (no such file, bad YAML, a wrong key or type) as one ValueError."""
    try:
        with open(path) as f:
            return from_dict(Config, yaml.safe_load(f) or {})
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read the recipe {path}: {e}") from e
    except ValueError as e:
        raise ValueError(f"recipe {path}: {e}") from e
