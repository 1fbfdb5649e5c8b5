"""The RL loop: asynchronous by default, with bounded staleness.

    instar rl                       # built-in tiny model on the built-in reverse task
    instar rl --config recipe.yaml  # anything else

    Stream (rollout thread)                            loop (this thread), step k
    ───────────────────────                            ──────────────────────────
    ticket t = the t-th group of the run               take(k): the next P tickets in order
    admitted while t < start[v] + (S + 1) P              (dynamic sampling: the next P with
      (v: the version the engines hold, Versions;         reward spread, refilled up to
       start[v]: step v + 1's first ticket)               --algo.max-resample more)
                                                       wait for the probe check of sync k-1
                                                       learn: advantages, E x M updates
    episodes: Env loop or ChatAgent via the gateway    sync k: shards -> /dev/shm -> engines
      tokens, behaviour log-probs, versions                (requests in flight pause and
                                                            resume on the new weights: a
                                                            partial rollout's tokens carry
                                                            both versions)
                                                       publish v = k: admits more tickets
                                                       the probe check of sync k runs on
                                                         the engines while step k+1 waits

With --rollout.schedule sequential (each phase then has all the cores) or max_staleness 0,
generation and training alternate (strictly on-policy); overlapping with S > 0, the groups
of the next S steps are generated while the trainer trains. Before step 1 the preflight
gate rescores fresh samples in the trainer; after every sync each engine's log-probs on a
fixed probe sequence must match the trainer's before its tokens are used.

`run` reads top to bottom: `setup` (every resource it takes is released by one ExitStack,
whatever raises), `begin` (resume, or eval and preflight), `train_step` for each step,
`after_step` (log, checkpoint, eval), `finish` (final eval, summary, export). A SIGTERM
(preemption) ends the run at the end of its step, once that step is checkpointed.

Multi-LoRA (`lora.adapters`): one trainer and one engine pool hold every adapter, and each
adapter is a `Run` of its own (its agent, data, stream, versions, probe, checkpoints and
metrics under lora/<name>/) sharing them; each step runs `train_step` for each in turn.
"""

import dataclasses
import json
import shutil
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import ray
import torch
from transformers import AutoConfig

from instar import bundle
from instar.agents.chat import as_messages, prompt_ids
from instar.cluster import ray_for
from instar.config import Config
from instar.evaluate import evaluate, mean
from instar.health import Health, rates
from instar.inputs import Inputs, other_model_paths, run_inputs, task_order
from instar.metrics import MISMATCH, TRUNCATED, RunLog, StepResult, dumps, spread, step_metrics
from instar.placement import place
from instar.plots import plot_run
from instar.preflight import preflight
from instar.processes import Preempted, deferred_sigterm, scratch_dir
from instar.progress import Bar, console
from instar.rollout.engine import stop_engines
from instar.rollout.runner import Batch, Rollouts
from instar.rollout.start import make_rollouts, sampling, start_engines
from instar.rollout.stream import Stream
from instar.rollout.versions import POLICY
from instar.sample import Sample, one_per_rollout, write_jsonl
from instar.train import checkpoint
from instar.train.advantages import informative, sample_advantages
from instar.train.batch import Sequence
from instar.train.losses import adaptive_kl, kl_BT
from instar.train.schedule import lr_at
from instar.train.sft import label_rows, warmup
from instar.train.trainer import Trainer
from instar.weight_sync import ProbeCheck, on_engines, sync_weights


@dataclass
class Run:
    """What the loop holds from setup to the end of the run, for one trained policy (with
    several LoRA adapters, one Run each, sharing the trainer, engines and log)."""

    cfg: Config
    """The run's config; an adapter's: with its agent, data, lr and staleness bound."""
    dir: Path
    """The run directory; an adapter's: adapters/<name>/ in it (rollouts, checkpoints, final)."""
    inputs: Inputs
    model: Path
    """The policy's starting checkpoint (after the warm-up, if any)."""
    trainer: Trainer
    others: dict[str, Trainer]
    """Other models the algorithm needs: reference, teacher, critic."""
    engines: list
    rollouts: Rollouts
    log: RunLog
    failures: IO
    weights: str
    """The folder (in /dev/shm where there is one) the ranks write weights to for the engines."""
    probe: list[int]
    check: ProbeCheck
    """The engines' probe check of the latest weight sync, not yet waited for."""
    kl_coef: float
    """The KL coefficient now (it moves with --algo.kl-target)."""
    ticket: int = 0
    """The stream's first ticket of the next step (dynamic sampling draws more than P a step)."""
    sync_bytes: int = 0
    """What the latest weight sync sent each engine (LoRA: the adapter alone)."""
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    failed: Counter = field(default_factory=Counter)
    name: str = ""
    """Multi-LoRA: the adapter's name (its policy on the engines); "": the run's one policy."""
    health: Health | None = None
    """The --health.* checks of its steps (which rates are over their warning)."""

    @property
    def policy(self) -> str:
        return self.name or POLICY

    @property
    def root(self) -> Path:
        """The run directory (an adapter's `dir` is in it)."""
        return self.dir.parent.parent if self.name else self.dir

    def tagged(self, m: dict) -> dict:
        """Metrics as logged: an adapter's under lora/<name>/."""
        return {k if k == "step" or not self.name else f"lora/{self.name}/{k}": v
                for k, v in m.items()}


def run(cfg: Config, inputs: list[Inputs] | None = None) -> dict:
    """`inputs`: each trained policy's model, data and agent (`Config.lanes`), already checked
    (default: read them now)."""
    cfg.validate()
    schedule, why = cfg.schedule_for()
    cfg = replace(cfg, rollout=replace(cfg.rollout, schedule=schedule))
    console.log(f"schedule: {schedule} ({why})")
    inputs = inputs or [run_inputs(c) for _, c in cfg.lanes()]
    with ExitStack() as stack:
        runs = setup(cfg, inputs, stack)
        starts = [begin(r) for r in runs]  # (adapters resumed from a save cut short differ)
        stopping = stack.enter_context(deferred_sigterm())  # SIGTERM: stop at the step's end
        streams = [open_stream(r) for r in runs]
        for stream in streams:
            stack.callback(release, stream.close)
        # a live bar on a terminal; in a log (Slurm), a line every --logging.print-every steps
        with Bar("step", cfg.train.steps, min(starts) - 1, live=cfg.logging.progress,
                 every=cfg.logging.print_every) as bar:
            for step in range(min(starts), cfg.train.steps + 1):
                due = [(r, s) for r, s, first in zip(runs, streams, starts) if step >= first]
                results = [train_step(r, stream, step) for r, stream in due]
                preempted = stopping()
                ms = [after_step(r, result, checkpoint_now=preempted)
                      for (r, _), result in zip(due, results)]
                m, rewards = ms[0], " ".join(f"{x['rollout/reward']:.3f}" for x in ms)
                bar.advance(1, f"reward {rewards} |Δlogp| "
                            f"{m.get('invariants/abs_logprob_diff', 0):.0e} "
                            f"{m['perf/gen_tokens_per_s']:.0f} tok/s | wait {m['timing/wait_s']:.1f}s"
                            f" train {m['timing/train_s']:.1f}s sync {m['timing/sync_s']:.1f}s")
                if preempted:  # (the groups of later steps are dropped: resumed, they are redone)
                    raise Preempted(f"stopped by SIGTERM after the checkpoint of step {step}; "
                                    "continue with --checkpoint.resume auto")
        for stream in streams:  # (no more training groups: the final eval has the engines alone)
            stream.close()
        summaries = {r.name: finish(r) for r in runs}
        if not runs[0].name:
            return {**summaries[""], "run_dir": str(runs[0].dir)}
        (runs[0].root / "summary.json").write_text(json.dumps({"adapters": summaries}, indent=2))
        return {"adapters": summaries, "run_dir": str(runs[0].root)}


def open_stream(r: Run) -> Stream:
    """The policy's training groups, in task order, within its staleness bound."""
    c = r.cfg
    a, ro = c.algo, c.rollout  # dynamic sampling: groups with no reward spread are dropped and refilled
    return Stream(r.rollouts, task_order(r.inputs.train_tasks, c.data.seed), c.data.prompts_per_step,
                  ro.group_size, sampling(c), 0 if ro.schedule == "sequential" else ro.max_staleness,
                  r.ticket, policy=r.policy, max_resample=a.max_resample if a.dynamic_filter else 0,
                  keep=lambda g: not a.dynamic_filter or bool(informative(g.samples)))


def release(fn, *args) -> None:
    """Run a clean-up step; if it fails, say so and go on with the others (the error that
    stopped the run, if any, is the one that propagates)."""
    try:
        fn(*args)
    except Exception as e:
        console.log(f"[yellow]clean-up: {getattr(fn, '__qualname__', fn)} failed: {e!r}")


def setup(cfg: Config, inputs: list[Inputs], stack: ExitStack) -> list[Run]:
    """Everything the run needs, each part released by `stack` whatever happens later: the
    trainer, engines and log, and a Run for each trained policy."""
    # absolute paths: Ray workers of a joined cluster do not run in this directory
    run_dir = Path(cfg.logging.root).absolute() / (cfg.logging.name or time.strftime("%Y%m%d-%H%M%S"))
    stack.enter_context(ray_for(cfg.cluster.ray_address))
    model = inputs[0].model_path
    if cfg.train.warmup_sft_steps:
        rows = inputs[0].warmup_rows or label_rows([t for i in inputs for t in i.train_tasks])
        model = warmup(cfg, model, rows, inputs[0].tokenizer)
    r, t, device = cfg.rollout, cfg.train, cfg.cluster.device
    engine_at, rank_at, pg = place(r.placement, device, r.num_engines, t.num_ranks, r.threads,
                                   t.threads_per_rank, cfg.cluster.engine_resource,
                                   cfg.cluster.trainer_resource, tensor_parallel=r.tensor_parallel,
                                   one_host=r.transport == "file" and not cfg.lora.rank)
    stack.callback(release, ray.util.remove_placement_group, pg)
    run_dir.mkdir(parents=True, exist_ok=True)  # (once the cluster holds the layout)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    console.log(f"run directory {run_dir}")
    trainer = Trainer(cfg, str(model), rank_at)
    stack.callback(release, trainer.shutdown)
    moe = getattr(AutoConfig.from_pretrained(model), "num_experts", 0) > 0
    if moe and device == "cpu":
        console.log("MoE routing is not recorded on CPU (vLLM returns routed experts from its "
                    "GPU model runner only): samples carry no routed_experts")
    engines = start_engines(cfg, model, engine_at, partial=r.partial, transport=r.transport,
                            capture_routing=moe and device == "cuda")
    stack.callback(release, stop_engines, engines)
    if r.transport != "file":
        trainer.connect(engines, r.transport)
    others = other_models(cfg, model)
    for other in others.values():
        stack.callback(release, other.shutdown)
    weights = scratch_dir()  # weights to the engines through RAM
    stack.callback(shutil.rmtree, weights, ignore_errors=True)
    dirs = [run_dir / "adapters" / name if name else run_dir for name, _ in cfg.lanes()]
    resume = cfg.checkpoint.resume and any(checkpoint.latest(d / "checkpoints") for d in dirs)
    log = RunLog(run_dir, dataclasses.asdict(cfg), resume=bool(resume),
                 tensorboard=cfg.logging.tensorboard, wandb_project=cfg.logging.wandb_project)
    stack.callback(release, log.close)
    runs = []
    for (name, c), i, d in zip(cfg.lanes(), inputs, dirs):
        d.mkdir(parents=True, exist_ok=True)
        policy, policy_trainer = name or POLICY, trainer.using(name) if name else trainer
        rollouts = make_rollouts(c, i.agent_cls, engines, i.tokenizer, model, policy)
        stack.callback(release, rollouts.close)
        failures = stack.enter_context(open(d / "failed_rollouts.jsonl", "a" if resume else "w"))
        probe = prompt_ids(i.tokenizer, as_messages(i.train_tasks[0].prompt), None)
        check = ProbeCheck(engines, probe, policy_trainer.probe(probe), r.sync_check_tol, policy)
        runs.append(Run(c, d, i, model, policy_trainer, others, engines, rollouts, log, failures,
                        weights, probe, check, c.algo.kl_coef, name=name,
                        health=Health(c.health)))
    return runs


def other_models(cfg: Config, model: Path) -> dict[str, Trainer]:
    """The models the algorithm needs besides the policy, built only when it needs them."""
    a, others, paths = cfg.algo, {}, other_model_paths(cfg)
    if a.kl_coef > 0:
        others["reference"] = Trainer(cfg, str(paths.get("reference", model)), frozen=True)
    if a.estimator == "on_policy_distill":
        others["teacher"] = Trainer(cfg, str(paths["teacher"]), frozen=True)
    if a.estimator == "gae":
        others["critic"] = Trainer(cfg, str(model), head="value", lr=a.critic_lr)
    return others


def begin(r: Run) -> int:
    """Resume from the newest checkpoint (the trainer's weights, optimizer and RNG, the step,
    the log), or, for a new run, eval before training and the preflight gate. The first step."""
    c = r.cfg
    path = c.checkpoint.resume and checkpoint.latest(r.dir / "checkpoints")
    if path:
        state = r.trainer.load_checkpoint(path)
        if "critic" in r.others:
            r.others["critic"].load_checkpoint(path.parent / "critic" / path.name)
        r.history, r.summary = state["history"], state["summary"]
        r.kl_coef = state.get("kl_coef", c.algo.kl_coef)  # (checkpoints from before they were kept)
        r.ticket = state.get("ticket", state["step"] * c.data.prompts_per_step)
        sync(r, state["step"])
        console.log(f"resumed from {path}: step {state['step'] + 1} next")
        return state["step"] + 1
    if c.checkpoint.resume:
        console.log(f"no checkpoint in {r.dir / 'checkpoints'}: starting afresh")
    if r.trainer.lora:  # the engines serve the fresh adapter from the start (it changes nothing
        sync(r, 0)      # yet: PEFT starts B at zero), so every token goes through it
    r.summary["eval_reward_before"] = evaluate_now(r, 0, "eval-before").get("eval/reward")
    if c.rollout.preflight:
        fresh = collect(r, r.rollouts.run(r.inputs.train_tasks[:c.rollout.preflight], 1,
                                          sampling(c), "preflight"), 0)
        r.summary["preflight_abs_logprob_diff"] = preflight(
            fresh, r.trainer, r.engines[0], c.rollout.temperature, c.rollout.preflight_tol,
            r.policy)
        tools = rates(one_per_rollout(fresh), r.failed)  # does its tool-call format parse?
        warn(r, 0, {k: v for k, v in tools.items() if k.startswith("rollout/tool_")})
    return 1


def train_step(r: Run, stream: Stream, step: int) -> StepResult:
    """One step: this step's groups, generated at versions >= step - 1 - max_staleness; the
    update; the weight sync (its probe check left running)."""
    t0 = time.time()
    batch, groups = Batch(), stream.take(step)
    for group in groups + stream.dropped:
        batch.add(group)
    r.ticket = stream.first
    samples = collect(r, batch, step)
    probe_diff = r.check.result()  # the engines hold weights step - 1: before any is trained on
    if not samples:
        raise RuntimeError(f"step {step}: every rollout failed ({dict(batch.failed)}); "
                           f"see {r.failures.name}")
    trained = [s for g in groups for s in g.samples]
    t1 = time.time()
    stats, scores = {}, None
    sleeps = r.cfg.rollout.placement == "colocated" and r.cfg.cluster.device == "cuda"
    if trained:
        if sleeps:  # colocated engines free the GPU while the trainer trains
            ray.get([e.sleep.remote() for e in r.engines])
        if dumps(step, r.cfg.logging.rollouts_every):
            scores = score(r.trainer, samples[:r.cfg.rollout.group_size], r.cfg.rollout.temperature)
        replay = bundle.begin(r, step)  # --logging.bundle-every: a replay bundle of the step
        stats = learn(trained, r.trainer, r.others, r.cfg, step, r.kl_coef)
        bundle.end(replay, r, trained, stats)
        if r.cfg.algo.kl_target and "kl" in stats:
            a = r.cfg.algo
            r.kl_coef = adaptive_kl(r.kl_coef, stats["kl"], a.kl_target, a.kl_horizon, len(trained))
        if sleeps:
            ray.get([e.wake_up.remote() for e in r.engines])
    else:
        console.log(f"step {step}: every group had equal rewards; no update")
    t2 = time.time()
    sync(r, step)
    t3 = time.time()
    return StepResult(step, batch, trained, stats, probe_diff, on_engines(r.engines, "stats"),
                      {"wait": t1 - t0, "train": t2 - t1, "sync": t3 - t2},
                      len(groups) + len(stream.dropped), len(stream.dropped), r.sync_bytes,
                      scores)


def score(trainer: Trainer, samples: list[Sample], temperature: float) -> list[list[float | None]]:
    """The trainer's log-probs of the samples' generated tokens (None elsewhere)."""
    seqs = [Sequence(s.tokens, s.loss_mask, [lp or 0.0 for lp in s.logprobs],
                     routed_experts=s.routed_experts, images=s.images) for s in samples]
    return [[lp if m else None for lp, m in zip(lps, s.loss_mask)]
            for s, lps in zip(samples, trainer.score(seqs, temperature))]


def learn(samples: list[Sample], trainer: Trainer, others: dict[str, Trainer], cfg: Config,
          step: int, kl_coef: float | None = None) -> dict:
    """A step's updates from its samples: the other models score them (reference, teacher,
    critic), advantages per token, then --algo.epochs passes over them, each shuffled and split
    into --algo.mini-batches optimizer steps of the policy (and the critic). `kl_coef`: the
    adaptive KL's current coefficient (default --algo.kl-coef)."""
    a = replace(cfg.algo, kl_coef=cfg.algo.kl_coef if kl_coef is None else kl_coef)
    temperature, E, M = cfg.rollout.temperature, a.epochs, a.mini_batches
    seqs = [Sequence(s.tokens, [m and not (a.overlong_mask and s.finish_reason in TRUNCATED)
                                for m in s.loss_mask], [lp or 0.0 for lp in s.logprobs],
                     fresh=[float(v == step - 1) for v in s.versions],
                     routed_experts=s.routed_experts, images=s.images) for s in samples]
    if not any(m for q in seqs for m in q.mask):
        return {}
    none = [None] * len(seqs)
    scores = {"logprobs": [q.behaviour_logprobs for q in seqs]}
    if "teacher" in others:
        scores["teacher_logprobs"] = others["teacher"].score(seqs, temperature)
    if "critic" in others:
        scores["values"] = others["critic"].score(seqs, temperature)
    ref = others["reference"].score(seqs, temperature) if "reference" in others else none
    kl = [kl_BT(torch.tensor(q.behaviour_logprobs), torch.tensor(r), a.kl_estimator).tolist()
          for q, r in zip(seqs, ref)] if "reference" in others and a.kl_in_reward else None
    penalty = kl and [[a.kl_coef * k for k in ks] for ks in kl]
    adv, returns = sample_advantages(samples, a, scores, penalty, cfg.rollout.max_tokens)
    old = trainer.score(seqs, temperature) if E * M > 1 else none  # the weights before the first update
    seqs = [replace(q, advantages=ad, ref_logprobs=rf, old_logprobs=o, returns=rt, old_values=v)
            for q, ad, rf, o, rt, v in zip(seqs, adv, ref, old, returns or none,
                                           scores.get("values", none))]
    lr, updates = lr_at(step, cfg.train), []
    shuffle = torch.Generator().manual_seed(cfg.data.seed * 1_000_003 + step)  # (exact resume)
    for _ in range(E):
        order = torch.randperm(len(seqs), generator=shuffle).tolist() if M > 1 else range(len(seqs))
        for part in ([seqs[i] for i in order[k::M]] for k in range(M)):
            updates.append(trainer.step(part, "pg", lr, a))
            if "critic" in others:
                updates[-1]["critic_loss"] = others["critic"].step(part, "value", a.critic_lr)["loss"]
    stats = {k: max(vs) if k.endswith("_max") else min(vs) if k.endswith("_min") else mean(vs)
             for k in updates[0] if (vs := [u[k] for u in updates if k in u])}
    fresh = updates[0]["mismatch_tokens"]  # measured before the step's first update only
    for k in [*MISMATCH, "mismatch_tokens"]:  # per lag-0 token; none when all are older
        stats.pop(k)
        if fresh and k in MISMATCH:
            stats[k] = updates[0][k] / fresh
    if len(updates) > 1:  # how far each update moved from the old policy (JSONL only)
        stats["updates"] = [{k: u[k] for k in ("loss", "clip_frac", "approx_kl", "ratio_max",
                                                "ratio_min", "grad_norm") if k in u}
                            for u in updates]
    seq_adv = [mean(a for a, m in zip(ad, s.loss_mask) if m) for s, ad in zip(samples, adv)]
    stats.update(lr=lr, **spread("adv", seq_adv), **({"kl_coef": a.kl_coef} if a.kl_target else {}))
    if kl is not None:  # the reference KL of the behaviour policy, per generated token
        stats["kl"] = mean(k for q, ks in zip(seqs, kl) for k, m in zip(ks, q.mask) if m)
    if "teacher" in others:  # reverse KL to the teacher on the student's own tokens
        diffs = [b - t for q, tl in zip(seqs, scores["teacher_logprobs"])
                 for b, t, m in zip(q.behaviour_logprobs, tl, q.mask) if m]
        stats["teacher_kl"] = mean(diffs)
    return stats


def sync(r: Run, version: int) -> None:
    """The trainer's weights into the engines as `version`; their probe check starts and
    becomes `r.check`. From here on the router and admission control go by `version`."""
    reload, r.check, r.sync_bytes = sync_weights(r.trainer, r.engines, r.weights, version,
                                                 r.probe, r.cfg.rollout.sync_check_tol,
                                                 r.cfg.rollout.transport, r.policy)
    r.rollouts.publish(version, reload, r.policy)  # (how an engine Ray restarts gets `version`)


def collect(r: Run, batch: Batch, step: int) -> list[Sample]:
    """The batch's samples; its failed attempts go to failed_rollouts.jsonl (with the step they
    were collected at) and the console."""
    for err in batch.errors:
        r.failures.write(json.dumps({"step": step, **err}) + "\n")
        console.log(f"[yellow]rollout {err['rollout_id']} failed ({err['reason']}), "
                    f"traceback in {r.failures.name}")
    r.failures.flush()
    r.failed.update(batch.failed)
    return batch.samples


def evaluate_now(r: Run, step: int, tag: str) -> dict:
    """Held-out eval on the weights the engines hold (checked first); logged at `step`."""
    if not r.inputs.eval_tasks:
        return {}
    r.check.result()
    m, batch = evaluate(r.rollouts, r.inputs.eval_tasks, r.cfg.eval, r.cfg.rollout.max_tokens, tag)
    collect(r, batch, step)
    r.log.log(r.tagged({"step": step, **m}), step)
    return m


def after_step(r: Run, result: StepResult, checkpoint_now: bool = False) -> dict:
    """Log the step; sample dump, checkpoint and eval when they are due (the checkpoint also
    when `checkpoint_now`). The step's metrics."""
    c, step = r.cfg, result.step
    m = step_metrics(result)
    r.history.append(m)
    r.log.log(r.tagged(m), step)
    if dumps(step, c.logging.rollouts_every):
        group = result.batch.samples[:c.rollout.group_size]
        scores = result.dumped_scores or [None] * len(group)  # (None: nothing was trained)
        write_jsonl(r.dir / "rollouts.jsonl", group, r.inputs.tokenizer,
                    [{"step": step, **({"trainer_logprobs": t} if t else {})} for t in scores])
        r.log.text(f"{r.name}/rollout/sample".lstrip("/"), group[0], r.inputs.tokenizer, step)
    if checkpoint_now or (c.checkpoint.every and step % c.checkpoint.every == 0):
        if "critic" in r.others:  # first, and one more kept: the policy's newest has its critic
            r.others["critic"].save_checkpoint(r.dir / "checkpoints" / "critic", step, {},
                                               c.checkpoint.keep + 1)
        r.trainer.save_checkpoint(r.dir / "checkpoints", step, {
            "step": step, "history": r.history, "summary": r.summary, "kl_coef": r.kl_coef,
            "ticket": r.ticket},
            c.checkpoint.keep)
    if c.eval.every and step % c.eval.every == 0 and step < c.train.steps:
        evaluate_now(r, step, f"eval-{step}")
    warn(r, step, m)
    return m


def warn(r: Run, step: int, m: dict) -> None:
    """The --health.* checks of a step's metrics (step 0: the preflight's): warnings go to the
    console and the summary; a rate past its stop threshold ends the run (HealthError)."""
    for text in r.health.check(m, step):
        console.log(f"[yellow]health{f' ({r.name})' if r.name else ''}: {text}")
        r.summary.setdefault("health_warnings", []).append(text)


def finish(r: Run) -> dict:
    """The final eval, the summary (written to summary.json), the exported model, the plots;
    returns the summary."""
    c, s, history = r.cfg, r.summary, r.history
    r.check.result()  # the weights the engines hold are the trainer's: those are exported
    s["eval_reward_after"] = evaluate_now(r, c.train.steps, "eval-after").get("eval/reward")
    if history:
        k = max(1, len(history) // 5)
        s.update(reward_first_step=history[0]["rollout/reward"],
                 reward_last_step=history[-1]["rollout/reward"],
                 reward_first_steps_mean=mean(h["rollout/reward"] for h in history[:k]),
                 reward_last_steps_mean=mean(h["rollout/reward"] for h in history[-k:]),
                 max_staleness_seen=max(h["staleness/max"] for h in history))
    s["failed_rollouts"] = dict(r.failed)
    if c.checkpoint.save_final:
        r.trainer.export(r.model, r.dir / "final")
    if c.logging.plots:  # (an adapter's: from its metrics in the run's metrics.jsonl)
        plot_run(r.root, f"lora/{r.name}/" if r.name else "", r.dir)
    (r.dir / "summary.json").write_text(json.dumps(s, indent=2))
    return s
