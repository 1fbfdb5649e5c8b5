"""The RL loop (synchronous): generate, score, one optimizer step, push weights, repeat.

    instar rl                       # built-in tiny model on the built-in reverse task
    instar rl --config recipe.yaml  # anything else

         tasks ──> Env episodes ──> engine (vLLM, Ray actor, weights v)
                        │  Samples: tokens, loss_mask, behaviour log-probs, versions
                        ▼
       advantages per token (--algo.estimator; GRPO by default, per group of rollouts)
                        ▼
        FSDP2 ranks (Ray actors): policy loss, global token mean, optimizer step
                        │  each rank's weight shards -> /dev/shm (or NCCL / CUDA IPC)
                        └──────────────> engine.load_weights(v + 1)

One step:
  1. take `prompts_per_step` tasks; run `group_size` episodes of each on the engines;
  2. `learn`: other models score the tokens where the algorithm needs them (a reference
     for KL, a teacher for distillation, a critic for GAE); advantages per token;
  3. each rank runs forward/backward on its micro-batches, then one optimizer step;
  4. the engines load the new weights, the version goes up by one;
  5. engines and trainer score a fixed probe sequence: a mismatch stops the run (checked
     before the next update, so the engines' probe overlaps the next rollouts).
"""

import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import AutoConfig, AutoTokenizer

from instar.agents.chat import as_messages, prompt_ids
from instar.agents.contract import Task
from instar.agents.loading import load_agent, load_tasks
from instar.cluster import rendezvous, start_ray
from instar.config import Config, TrainConfig
from instar.evaluate import evaluate, mean
from instar.metrics import RunLog
from instar.placement import place
from instar.plots import plot_run
from instar.rollout.engine import launch
from instar.rollout.runner import Batch, Rollouts, Stream
from instar.sample import Sample, one_per_rollout, write_jsonl
from instar.tasks.reverse_data import AGENT_FILE, reverse_data
from instar.tasks.tiny_model import builtin_model, cache_root
from instar.train import checkpoint
from instar.train.advantages import informative, sample_advantages
from instar.train.losses import kl_BT
from instar.train.worker import RANK_ENV, Sequence, TrainWorker, shard

console = Console()
MISMATCH = ("abs_logprob_diff", "k3")
"""Engine-vs-trainer mismatch on the step's lag-0 tokens, logged under invariants/."""


class Trainer:
    """A group of FSDP2 ranks holding one model: the policy, or a critic (`head="value"`), or a
    frozen reference or teacher (`frozen=True`). Every call goes to all of its ranks."""

    def __init__(self, cfg: Config, model_path: str, placement: list[dict] | None = None, *,
                 head: str = "lm", frozen: bool = False, lr: float | None = None):
        t, model_path = cfg.train, os.path.abspath(model_path)  # the ranks' cwd is not ours
        master = rendezvous()  # rank 0 posts its address there, on whichever node it runs
        default = dict(num_cpus=0, num_gpus=1 if t.device == "cuda" else 0)
        self.workers = [ray.remote(TrainWorker).options(**(placement[r] if placement else default),
                                                        runtime_env=RANK_ENV)
                        .remote(r, t.num_ranks, master, model_path, device=t.device,
                                dtype=cfg.model.dtype, threads=t.threads_per_rank,
                                lr=lr or t.lr, weight_decay=t.weight_decay,
                                freeze=(".*",) if frozen else tuple(t.freeze), head=head,
                                activation_checkpointing=t.activation_checkpointing,
                                cpu_offload=t.cpu_offload,
                                master_dtype=cfg.model.dtype if frozen else t.master_dtype,
                                routing_replay=t.routing_replay and head == "lm" and not frozen)
                        for r in range(t.num_ranks)]
        self.cfg = cfg

    def _shards(self, seqs: list[Sequence]) -> tuple[list[int], list]:
        """Sorted by length (less padding, even loads), then split over ranks and micro-batches."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].tokens))
        return order, shard([seqs[i] for i in order], len(self.workers),
                            self.cfg.train.micro_batch_tokens)

    def step(self, seqs: list[Sequence], loss: str, lr: float) -> dict[str, float]:
        """One optimizer step on `seqs`; the step's loss and stats."""
        c = self.cfg
        num_tokens = sum(sum(s.mask) for s in seqs)
        num_seqs = sum(any(s.mask) for s in seqs)
        per_rank = ray.get([w.train_step.remote(part, loss, c.algo, num_tokens, num_seqs,
                                                c.rollout.temperature, lr, c.train.grad_clip)
                            for w, part in zip(self.workers, self._shards(seqs)[1])])
        out = {k: sum(r.get(k, 0.0) for r in per_rank) for k in per_rank[0]}
        out["grad_norm"] = per_rank[0]["grad_norm"]  # the same on every rank
        return out

    def score(self, seqs: list[Sequence], temperature: float) -> list[list[float]]:
        """Per-token log-probs (a critic: values) of `seqs`, in order, under the current weights."""
        order, shards = self._shards(seqs)
        world, ranked = len(self.workers), [None] * len(seqs)
        for r, out in enumerate(ray.get([w.score.remote(part, temperature)
                                         for w, part in zip(self.workers, shards)])):
            ranked[r::world] = out
        scores = [None] * len(seqs)
        for j, i in enumerate(order):
            scores[i] = ranked[j]
        return scores

    def probe(self, ids: list[int]) -> list[float]:
        """Log-probs of one fixed sequence at temperature 1 (the sync fingerprint)."""
        return self.score([Sequence(ids, [True] * len(ids), [0.0] * len(ids))], 1.0)[0]

    def save_shards(self, folder: str) -> list[str]:
        """Each rank writes its shards of the weights that training changes; the files."""
        return ray.get([w.save_shard.remote(folder) for w in self.workers])

    def save_checkpoint(self, root: Path, step: int, state: dict, keep: int) -> None:
        ray.get([w.save_checkpoint.remote(str(root), step, state, keep) for w in self.workers])

    def load_checkpoint(self, path: Path) -> dict:
        return ray.get([w.load_checkpoint.remote(str(path)) for w in self.workers])[0]

    def connect(self, engines: list, transport: str) -> None:
        ray.get([w.connect.remote(engines, transport) for w in self.workers])

    def send_weights(self) -> None:
        ray.get([w.send_weights.remote() for w in self.workers])

    def save_weights(self, path: str) -> None:
        """The full weights in one file (every rank gathers, rank 0 writes)."""
        ray.get([w.save_weights.remote(path) for w in self.workers])

    def export(self, base: Path, out: Path) -> None:
        """Write an HF folder: the base model's config and tokenizer with the current weights."""
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
        for f in base.iterdir():
            if f.is_file() and f.name != "model.safetensors":
                shutil.copy(f, tmp / f.name)
        self.save_weights(str(tmp / "model.safetensors"))
        os.replace(tmp, out)

    def shutdown(self) -> None:
        ray.get([w.shutdown.remote() for w in self.workers])


def on_engines(engines: list, method: str, *args, refs: list | None = None) -> list:
    """Call `method` on every engine (or collect `refs`, the calls already made); an engine
    that died is waited for (Ray restarts it) and called again."""
    out = []
    for e, ref in zip(engines, refs or [getattr(e, method).remote(*args) for e in engines]):
        try:
            out.append(ray.get(ref))
        except RayActorError:
            wait_restarted(e)
            out.append(ray.get(getattr(e, method).remote(*args)))
    return out


def wait_restarted(engine) -> None:
    """Block until Ray has restarted `engine` ("unavailable" meanwhile; "died" if it gave up)."""
    while True:
        try:
            return ray.get(engine.__ray_ready__.remote())
        except ActorUnavailableError:
            time.sleep(1)


def verify_weights(engines: list, probe: list[int], expected: list[float], tol: float,
                   refs: list | None = None) -> float:
    """Fingerprint check: each engine scores the probe sequence (`refs`: those calls, already
    made); if its log-probs differ from the trainer's (`expected`) by more than `tol`, it does
    not hold the trainer's weights."""
    worst = 0.0
    for i, got in enumerate(on_engines(engines, "prompt_logprobs", probe, refs=refs)):
        diff = max(abs(a - b) for a, b in zip(got[1:], expected[1:]))
        if diff > tol:
            raise RuntimeError(f"weight sync check failed: on the probe sequence engine {i}'s "
                               f"log-probs differ from the trainer's by {diff:.2e} (> {tol:.0e}, "
                               "--rollout.sync-check-tol); the engine does not hold the "
                               "trainer's weights (a broken transfer, or a layer the engine "
                               "did not reload)")
        worst = max(worst, diff)
    return worst


def sync_weights(trainer: Trainer, engines: list, folder: str, version: int, probe: list[int],
                 tol: float, transport: str = "file") -> Callable[[], float]:
    """Push the trainer's weights into every engine as `version`. Returns their check, already
    running on the engines: call it (once or more; it waits once) before the new weights'
    tokens are trained on or evaluated."""
    if transport == "file":  # each rank's shards through `folder` (RAM), into reload_weights
        paths = trainer.save_shards(folder)
        loads = [e.load_weights.remote(paths, version) for e in engines]
        expected = trainer.probe(probe)  # while the engines load
        on_engines(engines, "load_weights", paths, version, refs=loads)  # (a restarted one too)
    else:  # device to device: NCCL or CUDA IPC
        ray.get([e.pause.remote(version) for e in engines])
        try:
            trainer.send_weights()
        finally:
            ray.get([e.resume.remote(version) for e in engines])
        expected = trainer.probe(probe)
    refs = [e.prompt_logprobs.remote(probe) for e in engines]
    return functools.cache(lambda: verify_weights(engines, probe, expected, tol, refs))


def warmup(cfg: Config, base: Path, tasks: list[Task], tokenizer) -> Path:
    """Supervised warm-up on the tasks' labels; the result is cached as an HF folder."""
    t = cfg.train
    key = hashlib.sha256(json.dumps([str(base), cfg.data.train, len(tasks), tasks[0].id,
                                     t.warmup_sft_steps, t.warmup_sft_lr, t.warmup_sft_batch,
                                     t.num_ranks, cfg.model.dtype, t.master_dtype,
                                     cfg.data.seed]).encode())
    out = cache_root() / "warm" / key.hexdigest()[:16]
    if (out / "model.safetensors").exists():
        return out
    if any(task.label is None for task in tasks):
        raise ValueError("--train.warmup-sft-steps needs a `label` on every training task; "
                         "set it to 0 for data without labels")
    trainer, rng = Trainer(cfg, str(base)), random.Random(cfg.data.seed)
    with Progress(TextColumn("warm-up (SFT, cached)"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=not cfg.logging.progress) as bar:
        for _ in bar.track(range(t.warmup_sft_steps)):
            seqs = []
            for task in rng.sample(tasks, t.warmup_sft_batch):
                prompt = prompt_ids(tokenizer, as_messages(task.prompt), None)
                answer = tokenizer.encode(str(task.label), add_special_tokens=False)
                answer.append(tokenizer.eos_token_id)
                seqs.append(Sequence(prompt + answer, [False] * len(prompt) + [True] * len(answer),
                                     [0.0] * (len(prompt) + len(answer))))
            trainer.step(seqs, "sft", t.warmup_sft_lr)
    trainer.export(base, out)
    trainer.shutdown()
    return out


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warm-up to `t.lr`, then constant or a cosine down to `t.min_lr_ratio * t.lr`."""
    if step <= t.lr_warmup_steps:
        return t.lr * step / t.lr_warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    done = (step - t.lr_warmup_steps) / max(1, t.steps - t.lr_warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 + math.cos(math.pi * done)) / 2)


def learn(samples: list[Sample], trainer: Trainer, others: dict[str, Trainer], cfg: Config,
          step: int) -> dict[str, float]:
    """One update from a step's samples: the other models score them (reference, teacher,
    critic), advantages per token, then the policy's optimizer step (and the critic's)."""
    a, temperature = cfg.algo, cfg.rollout.temperature
    seqs = [Sequence(s.tokens, s.loss_mask, [lp or 0.0 for lp in s.logprobs],
                     fresh=[float(v == step - 1) for v in s.versions],
                     routed_experts=s.routed_experts, images=s.images) for s in samples]
    none = [None] * len(seqs)
    scores = {"logprobs": [q.old_logprobs for q in seqs]}
    if "teacher" in others:
        scores["teacher_logprobs"] = others["teacher"].score(seqs, temperature)
    if "critic" in others:
        scores["values"] = others["critic"].score(seqs, temperature)
    ref = others["reference"].score(seqs, temperature) if "reference" in others else none
    penalty = [(a.kl_coef * kl_BT(torch.tensor(q.old_logprobs), torch.tensor(r),
                                  a.kl_estimator)).tolist() for q, r in zip(seqs, ref)] \
        if "reference" in others and a.kl_in_reward else None
    adv, returns = sample_advantages(samples, a.estimator, scores, penalty, a.gamma, a.lam)
    seqs = [replace(q, advantages=ad, ref_logprobs=rf) for q, ad, rf in zip(seqs, adv, ref)]
    lr = lr_at(step, cfg.train)
    stats = {**trainer.step(seqs, "pg", lr), "lr": lr}
    fresh = stats.pop("mismatch_tokens")
    for k in MISMATCH:  # per lag-0 token; none at all when every token of the step is older
        total = stats.pop(k)
        if fresh:
            stats[k] = total / fresh
    if "critic" in others:
        stats["critic_loss"] = others["critic"].step(
            [replace(q, returns=rt, old_values=v) for q, rt, v in zip(seqs, returns, scores["values"])],
            "value", a.critic_lr)["loss"]
    if "teacher" in others:  # reverse KL to the teacher on the student's own tokens
        diffs = [b - t for q, tl in zip(seqs, scores["teacher_logprobs"])
                 for b, t, m in zip(q.old_logprobs, tl, q.mask) if m]
        stats["teacher_kl"] = mean(diffs)
    return stats


def preflight(samples: list[Sample], trainer: Trainer, engine, temperature: float,
              tol: float) -> float:
    """Before step 1: the trainer rescores freshly sampled tokens; if its log-probs disagree
    with the engine's behaviour log-probs by more than `tol` (mean |Δ|), stop with the most
    likely cause. The mean |Δ| otherwise. (A loss mask on tokens the engine did not sample
    is refused earlier, when the Sample is built.)"""
    seqs = [Sequence(s.tokens, s.loss_mask, [lp or 0.0 for lp in s.logprobs], images=s.images)
            for s in samples]

    def mismatch(scores):
        return mean(abs(a - b) for q, sc in zip(seqs, scores)
                    for a, b, m in zip(q.old_logprobs, sc, q.mask) if m)
    diff = mismatch(trainer.score(seqs, temperature))
    if diff <= tol:
        return diff
    ids = seqs[0].tokens  # the same tokens, teacher-forced, in both: do the weights agree?
    weights = max(abs(a - b) for a, b in zip(ray.get(engine.prompt_logprobs.remote(ids))[1:],
                                             trainer.probe(ids)[1:]))
    if weights > tol:
        cause = (f"the engine and the trainer give the same tokens different log-probs "
                 f"({weights:.2e}): they hold different weights (stale weights, another "
                 "checkpoint) or compute differently (dtype)")
    elif mismatch(trainer.score(seqs, 1.0)) <= tol:
        cause = (f"the behaviour log-probs fit temperature 1.0, not {temperature}: the "
                 "sampling transform differs between engine and trainer")
    else:
        cause = ("the weights agree, so the sampled tokens came from another context than the "
                 "trainer sees: the sample's tokens are not the ones the engine was given (a "
                 "re-rendered prompt, a wrong chat template, re-tokenised text)")
    raise RuntimeError(f"preflight failed: on {len(samples)} fresh samples the trainer's "
                       f"log-probs differ from the engine's by {diff:.2e} on average (> "
                       f"{tol:.0e}, --rollout.preflight-tol). Likely cause: {cause}")


def run_inputs(cfg: Config):
    """Training tasks, held-out tasks, the agent class, the model folder and its tokenizer."""
    builtin_train, builtin_eval = reverse_data() if not cfg.data.train else ("", "")
    train_tasks = load_tasks(cfg.data.train or builtin_train)
    eval_tasks = load_tasks(cfg.data.eval or builtin_eval)[:cfg.eval.size] \
        if (cfg.data.eval or builtin_eval) else []
    agent_cls = load_agent(cfg.agent.file or AGENT_FILE)
    model_path = Path(cfg.model.path).absolute() if cfg.model.path else builtin_model(
        cfg.model.kind, cfg.model.size, cfg.model.seed)
    return train_tasks, eval_tasks, agent_cls, model_path, AutoTokenizer.from_pretrained(model_path)


def make_rollouts(cfg: Config, agent_cls, engines: list, tokenizer, model_path: Path) -> Rollouts:
    a, r = cfg.agent, cfg.rollout
    judge_engines = [] if a.judge in ("", "policy") else launch(  # a frozen judge, own engine
        a.judge, device=cfg.train.device, dtype=cfg.model.dtype, max_model_len=r.max_model_len,
        kv_cache_gb=r.kv_cache_gb, threads=r.threads, seed=cfg.data.seed)
    return Rollouts(agent_cls, a.config, engines, tokenizer, model_name=model_path.name,
                    max_model_len=r.max_model_len, on_failure=r.on_failure,
                    max_retries=r.max_retries, judge=a.judge, judge_engines=judge_engines,
                    limits={"max_turns": a.max_turns, "max_tokens": a.max_tokens,
                            "timeout_s": a.timeout_s})


def task_order(tasks: list[Task], seed: int):
    """The run's task sequence: ticket t -> a task; each epoch a fresh shuffle, fixed by the
    seed, so a resumed run knows which prompts come next from the step alone."""
    epochs: dict[int, list[int]] = {}

    def task_at(t: int) -> Task:
        epoch, i = divmod(t, len(tasks))
        if epoch not in epochs:
            epochs[epoch] = list(range(len(tasks)))
            random.Random(f"{seed}/{epoch}").shuffle(epochs[epoch])
        return tasks[epochs[epoch][i]]
    return task_at


def run(cfg: Config) -> dict:
    cfg.validate()
    # absolute paths: Ray workers of a joined cluster do not run in this directory
    run_dir = Path(cfg.logging.root).absolute() / (cfg.logging.name or time.strftime("%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    train_tasks, eval_tasks, agent_cls, model_path, tokenizer = run_inputs(cfg)

    logs = start_ray(cfg.cluster.ray_address)
    console.log(f"run directory {run_dir}; engine and trainer logs: {logs}")
    if cfg.train.warmup_sft_steps:
        model_path = warmup(cfg, model_path, train_tasks, tokenizer)
    r, t, P = cfg.rollout, cfg.train, cfg.data.prompts_per_step
    engine_at, rank_at = place(r.placement, t.device, r.num_engines, t.num_ranks, r.threads,
                               t.threads_per_rank, cfg.cluster.engine_resource,
                               cfg.cluster.trainer_resource, one_host=r.transport == "file")
    trainer = Trainer(cfg, str(model_path), rank_at)
    moe = getattr(AutoConfig.from_pretrained(model_path), "num_experts", 0) > 0
    if moe and t.device == "cpu":
        console.log("MoE routing is not recorded on CPU (vLLM returns routed experts from its "
                    "GPU model runner only): samples carry no routed_experts")
    engines = launch(str(model_path), device=t.device, dtype=cfg.model.dtype,
                     max_model_len=r.max_model_len, kv_cache_gb=r.kv_cache_gb,
                     threads=r.threads, seed=cfg.data.seed, count=r.num_engines,
                     placement=engine_at, partial=r.partial, max_staleness=r.max_staleness,
                     capture_routing=moe and t.device == "cuda", gpu_memory_utilization=r.gpu_memory,
                     transport=r.transport)
    if r.transport != "file":
        trainer.connect(engines, r.transport)
    sleeps = r.placement == "colocated" and t.device == "cuda"  # engines free the GPU to train
    probe = prompt_ids(tokenizer, as_messages(train_tasks[0].prompt), None)
    check = functools.cache(lambda: verify_weights(engines, probe, trainer.probe(probe),
                                                   r.sync_check_tol))
    check()  # the same weights at the start
    algo, others = cfg.algo, {}  # other models, built only when the algorithm needs them
    if algo.kl_coef > 0:
        others["reference"] = Trainer(cfg, algo.reference or str(model_path), frozen=True)
    if algo.estimator == "on_policy_distill":
        others["teacher"] = Trainer(cfg, algo.teacher, frozen=True)
    if algo.estimator == "gae":
        others["critic"] = Trainer(cfg, str(model_path), head="value", lr=algo.critic_lr)
    rollouts = make_rollouts(cfg, agent_cls, engines, tokenizer, model_path)
    sampling = {"temperature": r.temperature, "max_tokens": r.max_tokens, "ignore_eos": r.ignore_eos}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # weights to the engine via RAM
    weights = tempfile.mkdtemp(prefix="instar-", dir=shm)
    saved, start, history, summary, failed = run_dir / "checkpoints", 1, [], {}, Counter()
    resume_from = checkpoint.latest(saved) if cfg.checkpoint.resume else None
    log = RunLog(run_dir, dataclasses.asdict(cfg), resume=bool(resume_from),
                 tensorboard=cfg.logging.tensorboard, wandb_project=cfg.logging.wandb_project)
    failures_file = open(run_dir / "failed_rollouts.jsonl", "a" if resume_from else "w")

    def collect(batch: Batch) -> list[Sample]:
        for err in batch.errors:
            failures_file.write(json.dumps(err) + "\n")
            console.log(f"[yellow]rollout {err['rollout_id']} failed ({err['reason']}), "
                        f"traceback in {failures_file.name}")
        failures_file.flush()
        failed.update(batch.failed)
        return batch.samples

    def sync(version: int) -> None:
        nonlocal check  # the probe check runs on the engines while the loop moves on
        check = sync_weights(trainer, engines, weights, version, probe, r.sync_check_tol,
                             r.transport)
        rollouts.router.version, rollouts.router.weights = version, sorted(
            str(p) for p in Path(weights).glob("*.safetensors"))

    def evaluate_now(step: int, tag: str) -> dict:
        if not eval_tasks:
            return {}
        check()
        m, batch = evaluate(rollouts, eval_tasks, cfg.eval, r.max_tokens, tag)
        collect(batch)
        log.log({"step": step, **m}, step)
        return m

    if resume_from:  # the trainer's weights, optimizer and RNG, the step, the log
        state = trainer.load_checkpoint(resume_from)
        start, history, summary = state["step"] + 1, state["history"], state["summary"]
        sync(state["step"])
        console.log(f"resumed from {resume_from}: step {start} next")
    else:
        summary["eval_reward_before"] = evaluate_now(0, "eval-before").get("eval/reward")
        if r.preflight:
            fresh = collect(rollouts.run(train_tasks[:r.preflight], 1, sampling, "preflight"))
            summary["preflight_abs_logprob_diff"] = preflight(fresh, trainer, engines[0],
                                                              r.temperature, r.preflight_tol)
    stream = Stream(rollouts, task_order(train_tasks, cfg.data.seed), P, r.group_size,
                    sampling, r.max_staleness, first_ticket=(start - 1) * P, version=start - 1)
    columns = [TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=16),
               TimeElapsedColumn(), TextColumn("{task.description}")]
    with Progress(*columns, console=console, disable=not cfg.logging.progress) as bar:
        task_bar = bar.add_task("", total=cfg.train.steps, completed=start - 1)
        for step in range(start, cfg.train.steps + 1):
            t0 = time.time()
            result = Batch()
            for group in stream.take(step):  # this step's groups, generated at versions
                result.add(group)            # >= step - 1 - max_staleness
            samples = collect(result)
            probe_diff = check()  # the engines hold weights step - 1 (before any is trained on)
            if not samples:
                raise RuntimeError(f"step {step}: every rollout failed ({dict(result.failed)}); "
                                   f"see {failures_file.name}")
            episodes, sampled = one_per_rollout(samples), samples
            if algo.dynamic_filter:
                samples = informative(samples)
            t1 = time.time()
            stats = {}
            if samples:
                if sleeps:
                    ray.get([e.sleep.remote() for e in engines])
                stats = learn(samples, trainer, others, cfg, step)
                if sleeps:
                    ray.get([e.wake_up.remote() for e in engines])
            else:
                console.log(f"step {step}: every group had equal rewards; no update")
            t2 = time.time()
            sync(step)
            stream.set_version(step)
            t3 = time.time()
            engine_stats = on_engines(engines, "stats")
            lags = Counter(step - 1 - v for s in samples
                           for v, m in zip(s.versions, s.loss_mask) if m)
            info_keys = {k for s in episodes for k, v in s.info.items()
                         if isinstance(v, int | float) and not isinstance(v, bool)}
            m = {"step": step, "rollout/reward": mean(s.reward for s in episodes),
                 **{f"rollout/info/{k}": mean(s.info[k] for s in episodes if k in s.info)
                    for k in sorted(info_keys)},
                 "rollout/gen_tokens": sum(s.num_generated for s in sampled),
                 "rollout/failed": sum(result.failed.values()),
                 **{f"rollout/failed/{k}": v for k, v in result.failed.items()},
                 "rollout/restarted": result.restarted, "rollout/retried": result.retried,
                 "rollout/dropped_groups": result.dropped_groups,
                 "lengths/sampled_mean": mean(s.num_generated for s in sampled),
                 "lengths/trained_mean": mean(s.num_generated for s in samples),
                 **{f"engine/{i}/{k}": v for i, s in enumerate(engine_stats) for k, v in s.items()},
                 **{f"train/{k}": v for k, v in stats.items() if k not in MISMATCH},
                 **{f"invariants/{k}": stats[k] for k in MISMATCH if k in stats},
                 "invariants/sync_probe_diff": probe_diff,
                 **{f"staleness/lag_{k}": n / sum(lags.values()) for k, n in sorted(lags.items())},
                 "staleness/max": max(lags, default=0),
                 "timing/wait_s": t1 - t0, "timing/train_s": t2 - t1, "timing/sync_s": t3 - t2,
                 "timing/step_s": t3 - t0,
                 "perf/gen_tokens_per_s": sum(s["tokens_per_s"] for s in engine_stats),
                 "prompts": [g.removeprefix("t").split("-", 1)[1] for g in
                             dict.fromkeys(s.group_id for s in sampled)]}
            history.append(m)
            log.log(m, step)
            if step == 1 or (cfg.logging.rollouts_every and step % cfg.logging.rollouts_every == 0):
                write_jsonl(run_dir / "rollouts.jsonl", sampled[:r.group_size])
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                evaluate_now(step, f"eval-{step}")
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                trainer.save_checkpoint(saved, step, {"step": step, "history": history,
                                                      "summary": summary}, cfg.checkpoint.keep)
            bar.update(task_bar, advance=1, description=(
                f"reward {m['rollout/reward']:.3f} |Δlogp| "
                f"{m.get('invariants/abs_logprob_diff', 0):.0e} "
                f"{m['perf/gen_tokens_per_s']:.0f} tok/s | wait {t1 - t0:.1f}s "
                f"train {t2 - t1:.1f}s sync {t3 - t2:.1f}s"))
    stream.close()
    check()
    summary["eval_reward_after"] = evaluate_now(cfg.train.steps, "eval-after").get("eval/reward")
    log.close()
    failures_file.close()
    if history:
        summary["reward_first_step"] = history[0]["rollout/reward"]
        summary["reward_last_step"] = history[-1]["rollout/reward"]
        k = max(1, len(history) // 5)
        summary["reward_first_steps_mean"] = mean(h["rollout/reward"] for h in history[:k])
        summary["reward_last_steps_mean"] = mean(h["rollout/reward"] for h in history[-k:])
        summary["max_staleness_seen"] = max(h["staleness/max"] for h in history)
    summary["failed_rollouts"] = dict(failed)
    if cfg.checkpoint.save_final:
        trainer.export(model_path, run_dir / "final")
    if cfg.logging.plots:
        plot_run(run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    rollouts.close()
    ray.get([e.shutdown.remote() for e in engines])
    for group in [trainer, *others.values()]:
        group.shutdown()
    ray.shutdown()
    shutil.rmtree(weights, ignore_errors=True)
    return summary
