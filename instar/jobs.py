"""The jobs besides training, on the same config (and flags) as `instar rl`:

    instar rollout --agent FILE --data.train FILE --rollout.group-size 4   # no training
    instar eval --model.path DIR --data.eval FILE --eval.samples 4         # a checkpoint's eval
    instar serve --model.path DIR --serve.sessions 2                       # engines + gateway

Each starts Ray (--cluster.ray-address) and --rollout.num-engines engines on the model
(--model.*), samples with the --rollout.* settings, and writes into its run directory
(--logging.root/--logging.name; default name: the job and a timestamp):

    rollout   rollouts.jsonl (one Sample per segment, its decoded text beside),
              failed_rollouts.jsonl (reason and traceback of each failed attempt), summary.json
    eval      eval.json (reward, pass@k), eval_samples.jsonl (the same)
    serve     sessions.jsonl, written on Ctrl-C
"""

import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from transformers import AutoTokenizer

from instar.cluster import ray_for
from instar.config import Config
from instar.evaluate import evaluate
from instar.gateway.server import Gateway
from instar.hub import model_name
from instar.inputs import Inputs
from instar.progress import Bar
from instar.rollout.engine import stop_engines
from instar.rollout.router import Router
from instar.rollout.runner import Rollouts
from instar.rollout.start import make_rollouts, sampling, start_engines
from instar.rollout.versions import Versions
from instar.sample import one_per_rollout, write_jsonl


def run_dir(cfg: Config, job: str) -> Path:
    out = Path(cfg.logging.root) / (cfg.logging.name or time.strftime(f"{job}-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(cfg.to_yaml())
    return out


def save(path: Path, samples: list, tokenizer) -> None:
    path.unlink(missing_ok=True)  # (write_jsonl appends)
    write_jsonl(path, samples, tokenizer)


def episodes_bar(cfg: Config, total: int) -> Bar:
    """Episodes done of `total`: a bar, or a line every tenth of them."""
    return Bar("episodes", total, live=cfg.logging.progress, every=max(1, total // 10))


@contextmanager
def engines(cfg: Config, path: Path) -> Iterator[list]:
    """Ray and the engines on `path`; released on exit, whatever raised."""
    with ray_for(cfg.cluster.ray_address):
        policy = start_engines(cfg, path)
        try:
            yield policy
        finally:
            stop_engines(policy)


@contextmanager
def agent_rollouts(cfg: Config, inputs: Inputs) -> Iterator[Rollouts]:
    """The agent's episodes on fresh engines; closed on exit, whatever raised."""
    with engines(cfg, inputs.model_path) as policy:
        rollouts = make_rollouts(cfg, inputs.agent_cls, policy, inputs.tokenizer,
                                 inputs.model_path)
        try:
            yield rollouts
        finally:
            rollouts.close()


def rollout(cfg: Config, inputs: Inputs) -> dict:
    """`instar rollout`: --rollout.group-size episodes of each task of --data.train (empty:
    the built-in task) with the agent (--agent), no training. Failed episodes are counted and
    their tracebacks printed."""
    out = run_dir(cfg, "rollout")
    tasks, k = inputs.train_tasks, cfg.rollout.group_size
    with agent_rollouts(cfg, inputs) as rollouts, episodes_bar(cfg, k * len(tasks)) as bar:
        batch = rollouts.run(tasks, k, sampling(cfg), "rollout", bar.advance)
    save(out / "rollouts.jsonl", batch.samples, inputs.tokenizer)
    (out / "failed_rollouts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in batch.errors))
    episodes = one_per_rollout(batch.samples)
    n = max(len(episodes), 1)
    summary = {"episodes": len(episodes), "segments": len(batch.samples),
               "mean_reward": sum(s.reward for s in episodes) / n,
               "mean_turns": sum(s.info.get("turns", len(s.info.get("turn_rewards", [])))
                                 for s in episodes) / n,
               "failed": dict(batch.failed), "out": str(out / "rollouts.jsonl")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for err in batch.errors:
        Console(stderr=True).print(f"[yellow]{err['rollout_id']} failed:\n{err['traceback']}")
    Console().print_json(json.dumps(summary))
    return summary


def evaluate_model(cfg: Config, inputs: Inputs) -> dict:
    """`instar eval --model.path DIR`: the run's eval (--eval.*, --data.eval, --agent) on a
    checkpoint, without training."""
    out = run_dir(cfg, "eval")
    with agent_rollouts(cfg, inputs) as rollouts, \
            episodes_bar(cfg, cfg.eval.samples * len(inputs.eval_tasks)) as bar:
        metrics, batch = evaluate(rollouts, inputs.eval_tasks, cfg.eval, cfg.rollout.max_tokens,
                                  "eval", bar.advance)
    result = {"model": str(inputs.model_path), "tasks": len(inputs.eval_tasks), **metrics,
              "failed": dict(batch.failed)}
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    save(out / "eval_samples.jsonl", batch.samples, inputs.tokenizer)
    Console().print_json(json.dumps(result))
    return result


def serve(cfg: Config, path: Path) -> None:
    """`instar serve`: the engines behind the gateway on the model at `path`, --serve.sessions
    sessions sampled with the --rollout.* settings, until Ctrl-C (or SIGTERM); then the
    sessions are written."""
    out, r, tokenizer = run_dir(cfg, "serve"), cfg.rollout, AutoTokenizer.from_pretrained(path)
    with engines(cfg, path) as policy:
        generate = Router(policy, Versions(), hang_s=r.hang_s, seed=cfg.data.seed).generate
        gateway = Gateway(generate, tokenizer, model=model_name(path), stream=generate,
                          max_model_len=r.max_model_len, max_body_mb=r.max_request_mb).start()
        try:
            sids = [gateway.open_session(f"serve-{i}", "serve", sampling(cfg), 10**6,
                                         r.max_model_len) for i in range(cfg.serve.sessions)]
            print(f"api key: {gateway.api_key}\nmodel: {model_name(path)}")
            for sid in sids:
                openai_url, anthropic_url = gateway.urls(sid)
                print(f"session {sid}\n  OpenAI base URL:    {openai_url}\n"
                      f"  Anthropic base URL: {anthropic_url}", flush=True)
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            stop.wait()
            save(out / "sessions.jsonl", [s for sid in sids
                                          for s in gateway.close_session(sid).samples(0.0, {})],
                 tokenizer)
        finally:
            gateway.stop()
    print(f"wrote {out / 'sessions.jsonl'}")
