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
  5. engines and trainer score a fixed probe sequence: a mismatch stops the run.
"""

import hashlib
import json
import math
import os
import random
import shutil
import socket
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import ray
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import AutoConfig, AutoTokenizer

from instar.agents.chat import as_messages, prompt_ids
from instar.agents.contract import Task
from instar.agents.loading import load_agent, load_tasks
from instar.config import Config, TrainConfig
from instar.placement import place
from instar.rollout.engine import launch
from instar.rollout.runner import Batch, Rollouts
from instar.sample import Sample, one_per_rollout, write_jsonl
from instar.tasks.reverse_data import AGENT_FILE, reverse_data
from instar.tasks.tiny_model import builtin_model, cache_root
from instar.train import checkpoint
from instar.train.advantages import informative, sample_advantages
from instar.train.losses import kl_BT
from instar.train.worker import Sequence, TrainWorker, shard

console = Console()
MISMATCH = ("abs_logprob_diff", "k3")
"""Engine-vs-trainer mismatch of the step's tokens, logged under invariants/."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    """A group of FSDP2 ranks holding one model: the policy, or a critic (`head="value"`), or a
    frozen reference or teacher (`frozen=True`). Every call goes to all of its ranks."""

    def __init__(self, cfg: Config, model_path: str, placement: list[dict] | None = None, *,
                 head: str = "lm", frozen: bool = False, lr: float | None = None):
        t = cfg.train
        master = f"127.0.0.1:{free_port()}"
        default = dict(num_cpus=0, num_gpus=1 if t.device == "cuda" else 0)
        self.workers = [ray.remote(TrainWorker).options(**(placement[r] if placement else default))
                        .remote(r, t.num_ranks, master, model_path, device=t.device,
                                dtype=cfg.model.dtype, threads=t.threads_per_rank,
                                lr=lr or t.lr, weight_decay=t.weight_decay,
                                freeze=(".*",) if frozen else tuple(t.freeze), head=head,
                                activation_checkpointing=t.activation_checkpointing,
                                cpu_offload=t.cpu_offload)
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


def verify_weights(engines: list, probe: list[int], expected: list[float], tol: float) -> float:
    """Fingerprint check: each engine scores the probe sequence; if its log-probs differ from
    the trainer's (`expected`) by more than `tol`, it does not hold the trainer's weights."""
    worst = 0.0
    for i, got in enumerate(ray.get([e.prompt_logprobs.remote(probe) for e in engines])):
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
                 tol: float, transport: str = "file") -> float:
    """Push the trainer's weights into every engine as `version`, then check them."""
    if transport == "file":  # each rank's shards through `folder` (RAM), into reload_weights
        paths = trainer.save_shards(folder)
        loads = [e.load_weights.remote(paths, version) for e in engines]
        expected = trainer.probe(probe)  # while the engines load
        ray.get(loads)
    else:  # device to device: NCCL or CUDA IPC
        ray.get([e.pause.remote(version) for e in engines])
        try:
            trainer.send_weights()
        finally:
            ray.get([e.resume.remote(version) for e in engines])
        expected = trainer.probe(probe)
    return verify_weights(engines, probe, expected, tol)


def warmup(cfg: Config, base: Path, tasks: list[Task], tokenizer) -> Path:
    """Supervised warm-up on the tasks' labels; the result is cached as an HF folder."""
    t = cfg.train
    key = hashlib.sha256(json.dumps([str(base), cfg.data.train, len(tasks), tasks[0].id,
                                     t.warmup_sft_steps, t.warmup_sft_lr, t.warmup_sft_batch,
                                     t.num_ranks, cfg.model.dtype, cfg.data.seed]).encode())
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
    seqs = [Sequence(s.tokens, s.loss_mask, [lp or 0.0 for lp in s.logprobs]) for s in samples]
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
    old = trainer.score(seqs, temperature) if a.is_mode != "off" else none
    seqs = [replace(q, advantages=ad, trainer_logprobs=o, ref_logprobs=rf)
            for q, ad, o, rf in zip(seqs, adv, old, ref)]
    stats = trainer.step(seqs, "pg", lr_at(step, cfg.train))
    stats["lr"] = lr_at(step, cfg.train)
    if "critic" in others:
        stats["critic_loss"] = others["critic"].step(
            [replace(q, returns=rt, old_values=v) for q, rt, v in zip(seqs, returns, scores["values"])],
            "value", a.critic_lr)["loss"]
    if "teacher" in others:  # reverse KL to the teacher on the student's own tokens
        diffs = [b - t for q, tl in zip(seqs, scores["teacher_logprobs"])
                 for b, t, m in zip(q.old_logprobs, tl, q.mask) if m]
        stats["teacher_kl"] = mean(diffs)
    return stats


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def run(cfg: Config) -> dict:
    cfg.validate()
    run_dir = Path(cfg.logging.root) / (cfg.logging.name or time.strftime("%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    builtin_train, builtin_eval = reverse_data() if not cfg.data.train else ("", "")
    train_tasks = load_tasks(cfg.data.train or builtin_train)
    eval_tasks = load_tasks(cfg.data.eval or builtin_eval)[:cfg.data.eval_size] \
        if (cfg.data.eval or builtin_eval) else []
    agent_cls = load_agent(cfg.agent.file or AGENT_FILE)
    model_path = Path(cfg.model.path) if cfg.model.path else builtin_model(
        cfg.model.kind, cfg.model.size, cfg.model.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_LOGGING_LEVEL": "WARNING"}})
    console.log(f"run directory {run_dir}; engine and trainer logs: /tmp/ray/session_latest/logs")
    if cfg.train.warmup_sft_steps:
        model_path = warmup(cfg, model_path, train_tasks, tokenizer)
    r, t = cfg.rollout, cfg.train
    engine_at, rank_at = place(r.placement, t.device, r.num_engines, t.num_ranks, r.threads,
                               t.threads_per_rank)
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
    verify_weights(engines, probe, trainer.probe(probe), r.sync_check_tol)  # same start
    algo, others = cfg.algo, {}  # other models, built only when the algorithm needs them
    if algo.kl_coef > 0:
        others["reference"] = Trainer(cfg, algo.reference or str(model_path), frozen=True)
    if algo.estimator == "on_policy_distill":
        others["teacher"] = Trainer(cfg, algo.teacher, frozen=True)
    if algo.estimator == "gae":
        others["critic"] = Trainer(cfg, str(model_path), head="value", lr=algo.critic_lr)
    a = cfg.agent
    rollouts = Rollouts(agent_cls, a.config, engines, tokenizer, model_name=model_path.name,
                        max_model_len=r.max_model_len,
                        limits={"max_turns": a.max_turns, "max_tokens": a.max_tokens,
                                "timeout_s": a.timeout_s})
    sampling = {"temperature": r.temperature, "max_tokens": r.max_tokens}
    eval_sampling = {"temperature": r.eval_temperature, "max_tokens": r.max_tokens}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # weights to the engine via RAM
    weights = tempfile.mkdtemp(prefix="instar-", dir=shm)
    rng, order, history, failed = random.Random(cfg.data.seed), [], [], Counter()
    saved, start = run_dir / "checkpoints", 1
    resume_from = checkpoint.latest(saved) if cfg.checkpoint.resume else None
    metrics_file = open(run_dir / "metrics.jsonl", "a" if resume_from else "w")
    failures_file = open(run_dir / "failed_rollouts.jsonl", "a" if resume_from else "w")

    def collect(batch: Batch) -> list[Sample]:
        for err in batch.errors:
            failures_file.write(json.dumps(err) + "\n")
            console.log(f"[yellow]rollout {err['rollout_id']} failed ({err['reason']}), "
                        f"traceback in {failures_file.name}")
        failures_file.flush()
        failed.update(batch.failed)
        return batch.samples

    def evaluate(tag):
        samples = collect(rollouts.run(eval_tasks, 1, eval_sampling, tag)) if eval_tasks else []
        return mean(s.reward for s in one_per_rollout(samples))

    if resume_from:  # the trainer's weights, optimizer and RNG, the data position, the log
        state = trainer.load_checkpoint(resume_from)
        start, order, history, summary = (state["step"] + 1, state["order"], state["history"],
                                          state["summary"])
        rng.setstate(state["rng"])
        sync_weights(trainer, engines, weights, state["step"], probe, r.sync_check_tol,
                     r.transport)
        console.log(f"resumed from {resume_from}: step {start} next")
    else:
        summary = {"eval_reward_before": evaluate("eval-before")}
    columns = [TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=16),
               TimeElapsedColumn(), TextColumn("{task.description}")]
    with Progress(*columns, console=console, disable=not cfg.logging.progress) as bar:
        task_bar = bar.add_task("", total=cfg.train.steps, completed=start - 1)
        for step in range(start, cfg.train.steps + 1):
            t0 = time.time()
            if len(order) < cfg.data.prompts_per_step:  # next epoch
                order = list(range(len(train_tasks)))
                rng.shuffle(order)
            batch = [train_tasks[order.pop()] for _ in range(cfg.data.prompts_per_step)]
            ray.get([e.stats.remote() for e in engines])  # per-engine figures of this rollout
            result = rollouts.run(batch, r.group_size, sampling, f"s{step}")
            samples = collect(result)
            if not samples:
                raise RuntimeError(f"step {step}: every rollout failed ({dict(result.failed)}); "
                                   f"see {failures_file.name}")
            episodes = one_per_rollout(samples)
            if algo.dynamic_filter:
                samples = informative(samples)
                if not samples:
                    console.log(f"step {step}: every group had equal rewards; no update")
                    continue
            t1 = time.time()
            engine_stats = ray.get([e.stats.remote() for e in engines])
            if sleeps:
                ray.get([e.sleep.remote() for e in engines])
            stats = learn(samples, trainer, others, cfg, step)
            if sleeps:
                ray.get([e.wake_up.remote() for e in engines])
            t2 = time.time()
            probe_diff = sync_weights(trainer, engines, weights, step, probe, r.sync_check_tol,
                                      r.transport)
            t3 = time.time()
            gen_tokens = sum(s.num_generated for s in samples)
            info_keys = {k for s in episodes for k, v in s.info.items()
                         if isinstance(v, int | float) and not isinstance(v, bool)}
            m = {"step": step, "rollout/reward": mean(s.reward for s in episodes),
                 **{f"rollout/info/{k}": mean(s.info[k] for s in episodes if k in s.info)
                    for k in sorted(info_keys)},
                 "rollout/gen_tokens": gen_tokens, "rollout/failed": sum(result.failed.values()),
                 "rollout/restarted": result.restarted,
                 **{f"engine/{i}/{k}": v for i, s in enumerate(engine_stats) for k, v in s.items()},
                 **{f"rollout/failed/{k}": v for k, v in result.failed.items()},
                 **{f"train/{k}": v for k, v in stats.items() if k not in MISMATCH},
                 **{f"invariants/{k}": stats[k] for k in MISMATCH},
                 "invariants/sync_probe_diff": probe_diff,
                 "timing/rollout_s": t1 - t0, "timing/train_s": t2 - t1, "timing/sync_s": t3 - t2,
                 "perf/gen_tokens_per_s": gen_tokens / (t1 - t0)}
            history.append(m)
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()
            if step == 1:
                write_jsonl(run_dir / "rollouts.jsonl", samples[:r.group_size])
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                trainer.save_checkpoint(saved, step, {"step": step, "order": order,
                                                      "rng": rng.getstate(), "history": history,
                                                      "summary": summary}, cfg.checkpoint.keep)
            bar.update(task_bar, advance=1, description=(
                f"reward {m['rollout/reward']:.3f} |Δlogp| {m['invariants/abs_logprob_diff']:.0e} "
                f"{m['perf/gen_tokens_per_s']:.0f} tok/s | rollout {t1 - t0:.1f}s "
                f"train {t2 - t1:.1f}s sync {t3 - t2:.1f}s"))
    summary["eval_reward_after"] = evaluate("eval-after")
    metrics_file.close()
    failures_file.close()
    if history:
        summary["reward_first_step"] = history[0]["rollout/reward"]
        summary["reward_last_step"] = history[-1]["rollout/reward"]
        k = max(1, len(history) // 5)
        summary["reward_first_steps_mean"] = mean(h["rollout/reward"] for h in history[:k])
        summary["reward_last_steps_mean"] = mean(h["rollout/reward"] for h in history[-k:])
    summary["failed_rollouts"] = dict(failed)
    if cfg.checkpoint.save_final:
        trainer.export(model_path, run_dir / "final")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    rollouts.close()
    ray.get([e.shutdown.remote() for e in engines])
    for group in [trainer, *others.values()]:
        group.shutdown()
    ray.shutdown()
    shutil.rmtree(weights, ignore_errors=True)
    return summary
