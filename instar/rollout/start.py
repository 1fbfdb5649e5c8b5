"""Engines and rollouts from a run config: what `instar rl`, `eval`, `rollout` and `serve`
all start the same way."""

from pathlib import Path

import ray

from instar.config import Config
from instar.hub import model_name, resolve_model
from instar.progress import status
from instar.rollout.engine import launch, stop_engines
from instar.rollout.parsers import check
from instar.rollout.runner import Rollouts
from instar.rollout.runners import Runners
from instar.tasks.reverse_data import AGENT_FILE
from instar.train import lora


def start_engines(cfg: Config, model_path: str | Path, placement: list[dict] | None = None,
                  **options) -> list:
    """`--rollout.num-engines` engines on `model_path` (Ray must be up); `options` go to
    `Engine` (partial rollout, routing capture, the GPU transport). Parser names the run gives
    are checked first. LoRA: the engines take adapters up to --lora.rank; with --lora.path
    they serve that adapter (as version 0)."""
    r, m = cfg.rollout, cfg.model
    check(m.tool_parser, m.reasoning_parser)
    adapter = lora.read(cfg.lora.path) if cfg.lora.path else None
    rank, targets = (adapter["config"]["r"], adapter["config"]["target_modules"]) if adapter \
        else (cfg.lora.rank, cfg.lora.targets)
    targets = lora.engine_modules(str(model_path), targets) if rank else ()  # what they wrap
    with status(f"starting {r.num_engines} vLLM engine{'s' * (r.num_engines > 1)}"):
        engines = launch(str(model_path), device=cfg.cluster.device, dtype=cfg.model.dtype,
                         max_model_len=r.max_model_len, kv_cache_gb=r.kv_cache_gb,
                         threads=r.threads, seed=cfg.data.seed, count=r.num_engines,
                         placement=placement, tensor_parallel=r.tensor_parallel,
                         gpu_memory_utilization=r.gpu_memory, tool_parser=m.tool_parser,
                         reasoning_parser=m.reasoning_parser,
                         lora_rank=rank, lora_targets=targets, **options)
    try:  # (vLLM may refuse the adapter: the engines end with the error)
        ray.get([e.load_adapter.remote(adapter, 0) for e in engines if adapter])
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def sampling(cfg: Config) -> dict:
    """The sampling settings of the run's episodes."""
    r = cfg.rollout
    return {"temperature": r.temperature, "max_tokens": r.max_tokens, "ignore_eos": r.ignore_eos}


def make_rollouts(cfg: Config, agent_cls: type, engines: list, tokenizer,
                  model_path: Path) -> Rollouts:
    """The agent's episodes on `engines`, with the run's limits and failure policy; a frozen
    judge (`--agent.judge`: a folder or Hub id) gets an engine of its own, shut down with the
    rollouts. With `--rollout.runners N`, the episodes run in N runner processes."""
    a, r = cfg.agent, cfg.rollout
    judge = a.judge if a.judge in ("", "policy") else str(resolve_model(a.judge, "--agent.judge"))
    judge_engines = [] if judge in ("", "policy") else launch(
        judge, device=cfg.cluster.device, dtype=cfg.model.dtype, max_model_len=r.max_model_len,
        kv_cache_gb=r.kv_cache_gb, threads=r.threads, seed=cfg.data.seed,
        tensor_parallel=r.tensor_parallel)
    options = dict(model_name=model_name(model_path), max_model_len=r.max_model_len,
                   on_failure=r.on_failure, max_retries=r.max_retries, judge=judge,
                   judge_engines=judge_engines, hang_s=r.hang_s, max_request_mb=r.max_request_mb,
                   seed=cfg.data.seed, limits={"max_turns": a.max_turns,
                                               "max_tokens": a.max_tokens, "timeout_s": a.timeout_s})
    if r.runners:  # (each runner loads the agent file itself)
        return Runners(r.runners, cfg.cluster.runner_resource, a.file or AGENT_FILE, a.config,
                       engines, tokenizer, **options)
    return Rollouts(agent_cls, a.config, engines, tokenizer, **options)
