"""The jobs besides training: `instar rollout` (an agent over a dataset, no training),
`instar eval` (the held-out eval of a checkpoint) and `instar serve` (the engine and the
gateway on their own, for external harnesses)."""

import json
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
from rich.console import Console
from transformers import AutoTokenizer

from instar.agents.loading import load_agent, load_tasks
from instar.cluster import start_ray
from instar.config import Config
from instar.evaluate import evaluate
from instar.gateway.server import Gateway
from instar.rollout.engine import launch
from instar.rollout.router import Router
from instar.rollout.runner import Rollouts
from instar.sample import one_per_rollout, write_jsonl
from instar.tasks.tiny_model import builtin_model


@dataclass
class EngineArgs:
    model: str = ""
    """Hugging Face checkpoint folder. Empty: the built-in tiny model."""
    temperature: float = 1.0
    """Sampling temperature."""
    max_tokens: int = 256
    """Most new tokens per model turn."""
    max_model_len: int = 2048
    """Longest context the engine accepts."""
    device: str = "cpu"
    """cpu or cuda."""


@dataclass
class RolloutArgs(EngineArgs):
    """Run an agent over a dataset with a model (no training); write the samples as JSONL."""

    agent: str = ""
    """Agent file (`path.py` or `path.py:ClassName`)."""
    data: str = ""
    """Tasks, JSONL with at least `prompt`."""
    out: str = "rollouts.jsonl"
    """Where to write the samples (one JSON line per segment)."""
    n_samples: int = 1
    """Episodes per task."""
    agent_config: dict[str, str] = field(default_factory=dict)
    """Keyword arguments for the agent's constructor."""
    judge: str = ""
    """A judge model for the agent (`self.judge`): "policy" or a Hugging Face folder (its own
    engine). Empty: none."""


@dataclass
class ServeArgs(EngineArgs):
    """Serve the engine behind the gateway; print the base URLs and the key."""

    sessions: int = 1
    """Episodes (sessions) to open; each gets its own pair of base URLs."""
    out: str = ""
    """If set, write the captured sessions as JSONL samples here on exit."""


def _launch(model: str, args: EngineArgs) -> list:
    return launch(model, device=args.device, dtype="float32" if args.device == "cpu"
                  else "bfloat16", max_model_len=args.max_model_len, kv_cache_gb=1, threads=2,
                  seed=0)


def _engine(args: EngineArgs):
    model = Path(args.model) if args.model else builtin_model()
    ray.init(include_dashboard=False, log_to_driver=False)
    return model, AutoTokenizer.from_pretrained(model), _launch(str(model), args)


def rollout(args: RolloutArgs) -> dict:
    if not args.agent or not args.data:
        raise ValueError("instar rollout needs --agent FILE and --data FILE")
    agent_cls, tasks = load_agent(args.agent), load_tasks(args.data)
    model, tokenizer, engines = _engine(args)
    judge_engines = [] if args.judge in ("", "policy") else _launch(args.judge, args)
    runner = Rollouts(agent_cls, args.agent_config, engines, tokenizer, model_name=model.name,
                      max_model_len=args.max_model_len, limits={}, judge=args.judge,
                      judge_engines=judge_engines)
    batch = runner.run(tasks, args.n_samples, {"temperature": args.temperature,
                                               "max_tokens": args.max_tokens}, "rollout")
    runner.close()
    Path(args.out).unlink(missing_ok=True)
    write_jsonl(args.out, batch.samples)
    episodes = one_per_rollout(batch.samples)
    n = max(len(episodes), 1)
    summary = {"episodes": len(episodes), "segments": len(batch.samples),
               "mean_reward": sum(s.reward for s in episodes) / n,
               "mean_turns": sum(s.info.get("turns", len(s.info.get("turn_rewards", [])))
                                 for s in episodes) / n,
               "failed": dict(batch.failed), "out": args.out}
    for err in batch.errors:
        Console(stderr=True).print(f"[yellow]{err['rollout_id']} failed:\n{err['traceback']}")
    Console().print_json(json.dumps(summary))
    ray.shutdown()
    return summary


def evaluate_model(cfg: Config) -> dict:
    """`instar eval --model.path DIR`: the run's eval (--eval.*, --data.eval, --agent) on a
    checkpoint, without training; writes eval.json and eval_samples.jsonl to a run directory."""
    from instar.loop import make_rollouts, run_inputs

    _, tasks, agent_cls, model_path, tokenizer = run_inputs(cfg)
    if not tasks:
        raise ValueError("instar eval needs held-out tasks: --data.eval FILE and --eval.size > 0")
    out = Path(cfg.logging.root) / (cfg.logging.name or time.strftime("eval-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    start_ray(cfg.cluster.ray_address)
    r = cfg.rollout
    engines = launch(str(model_path), device=cfg.train.device, dtype=cfg.model.dtype,
                     max_model_len=r.max_model_len, kv_cache_gb=r.kv_cache_gb, threads=r.threads,
                     seed=cfg.data.seed, count=r.num_engines)
    rollouts = make_rollouts(cfg, agent_cls, engines, tokenizer, model_path)
    metrics, batch = evaluate(rollouts, tasks, cfg.eval, r.max_tokens, "eval")
    rollouts.close()
    ray.shutdown()
    result = {"model": str(model_path), "tasks": len(tasks), **metrics,
              "failed": dict(batch.failed)}
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    write_jsonl(out / "eval_samples.jsonl", batch.samples)
    Console().print_json(json.dumps(result))
    return result


def serve(args: ServeArgs) -> None:
    model, tokenizer, engines = _engine(args)
    gateway = Gateway(Router(engines).generate, tokenizer, model=model.name,
                      max_model_len=args.max_model_len).start()
    sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    sids = [gateway.open_session(f"serve-{i}", "serve", sampling, 10**6, args.max_model_len)
            for i in range(args.sessions)]
    print(f"api key: {gateway.api_key}\nmodel: {model.name}")
    for sid in sids:
        openai_url, anthropic_url = gateway.urls(sid)
        print(f"session {sid}\n  OpenAI base URL:    {openai_url}\n"
              f"  Anthropic base URL: {anthropic_url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if args.out:
        Path(args.out).unlink(missing_ok=True)
        for sid in sids:
            write_jsonl(args.out, gateway.close_session(sid).samples(0.0, {}))
        print(f"wrote {args.out}")
    gateway.stop()
    ray.shutdown()
