"""`instar replay BUNDLE`: one step of `instar rl` recomputed from its replay bundle
(instar/bundle.py) on this machine's CPU, starting no Ray, engine or vLLM, and compared with
what the run recorded.

    instar replay runs/RUN/bundles/step-00000010                     # the run's rank count
    instar replay runs/RUN/bundles/step-00000010 --ranks 1 --tolerance 1e-4

1. `--ranks` processes (default: the run's rank count; one: this process) form a gloo group.
2. Each builds its rank of the policy (and of the reference, teacher or critic the config
   needs) from the run's starting checkpoint, then loads the bundle's before/ checkpoint:
   trained weights, AdamW state, its RNG (DCP reshards it to any rank count).
3. Every process runs the loop's own `learn` on the bundle's samples, with the step and
   kl_coef of bundle.json, through `Local`: a trainer's `step` and `score` over the group,
   each rank on its shard as the trainer's Ray actors are, the results gathered.
4. Rank 0 compares the loss and grad norm with bundle.json's, and the updated weights with
   after/'s: the largest |difference| of any trained weight.

On the run's rank count the shards, micro-batches, reductions and threads are the run's, so
the replay is bitwise the run's step; on another the sums run in another order (--tolerance).
A GPU run's bundle replays on the CPU to a tolerance too (other kernels).
"""

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers.utils import logging as hf_logging

from instar.bundle import Bundle
from instar.config import Config
from instar.inputs import other_model_paths
from instar.loop import learn
from instar.train.batch import Sequence, split, unsplit
from instar.train.checkpoint import latest, rng_state, set_rng_state
from instar.train.rank import Rank, free_port
from instar.train.trainer import merged, rank_options

COMPARED = ("loss", "grad_norm", "critic_loss")
"""The step's stats a replay compares (those the step has)."""


class Local:
    """A trainer's `step` and `score` over this process's rank of a group whose processes all
    make the same calls (no Ray): each rank takes its shard, as a Trainer's ranks do. Several
    models share the process, so each keeps its own RNG (for dropout, such as --lora.dropout), as
    in a process of its own: the one the process has when it is made, then its own."""

    def __init__(self, rank: Rank, cfg: Config):
        self.rank, self.cfg, self.rng = rank, cfg, rng_state()

    def _call(self, method: str, seqs: list[Sequence], *args):
        """Rank method `method` on this rank's shard of `seqs`, under this model's RNG; every
        rank's result, and the order of `split`."""
        order, shards = split(seqs, self.rank.world, self.cfg.train.micro_batch_tokens)
        set_rng_state(self.rng)
        mine = getattr(self.rank, method)(shards[self.rank.rank], *args)
        self.rng = rng_state()
        return gathered(mine), order

    def step(self, seqs: list[Sequence], loss: str, lr: float, algo=None) -> dict[str, float]:
        c = self.cfg
        return merged(self._call("train_step", seqs, loss, algo or c.algo,
                                 sum(sum(s.mask) for s in seqs), sum(any(s.mask) for s in seqs),
                                 c.rollout.temperature, lr, c.train.grad_clip)[0])

    def score(self, seqs: list[Sequence], temperature: float) -> list[list[float]]:
        per_rank, order = self._call("score", seqs, temperature)
        return unsplit(order, per_rank)


def gathered(mine) -> list:
    """Every rank's `mine`, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def weights(rank: Rank) -> dict[str, torch.Tensor]:
    """Copies of the rank's trained weights (DTensors: it holds its shards)."""
    trained = {n for n, p in rank.model.named_parameters() if p.requires_grad}
    return {k: v.detach().clone() for k, v in get_model_state_dict(rank.model).items()
            if k in trained}


def farthest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a - b| of any weight, over every rank's shards."""
    local = [x.to_local() if isinstance(x, DTensor) else x for x in a.values()]
    other = [x.to_local() if isinstance(x, DTensor) else x for x in (b[k] for k in a)]
    top = torch.tensor(max([(x - y).abs().max().item() for x, y in zip(local, other)
                            if x.numel()], default=0.0), dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return top.item()


def saved(rank: Rank, path) -> dict[str, torch.Tensor]:
    """The trained weights of checkpoint `path`, sharded as the rank holds its own."""
    out = weights(rank)
    dcp.load({"model": out}, checkpoint_id=path)
    return out


def recompute(b: Bundle) -> dict:
    """Steps 2-4 on this process's rank (the group is up): the replayed stats, and how far the
    replayed weights are from after/ and from where the step started."""
    cfg = replace(b.cfg, cluster=replace(b.cfg.cluster, device="cpu"),
                  train=replace(b.cfg.train, cpu_offload=False))  # (a GPU run's setting)
    a, model, paths = cfg.algo, b.meta["model"], other_model_paths(cfg)
    before, after = b.folder / "before", b.folder / "after"

    def local(path, start: Path | None = None, **options) -> Local:
        """A model's rank, from checkpoint folder `start` if the bundle has it (its RNG too,
        which Local takes)."""
        rank = Rank(str(path), **rank_options(cfg, **options))
        if start and start.exists():
            rank.load_checkpoint(latest(start))
        return Local(rank, cfg)

    others = {}
    if a.kl_coef > 0:
        others["reference"] = local(paths.get("reference", model), frozen=True)
    if a.estimator == "on_policy_distill":
        others["teacher"] = local(paths["teacher"], frozen=True)
    if a.estimator == "gae":
        others["critic"] = local(model, before / "critic", head="value", lr=a.critic_lr)
    policy = local(model, before)
    start = weights(policy.rank)
    stats = learn(b.samples, policy, others, cfg, b.meta["step"], b.meta["kl_coef"])
    now = weights(policy.rank)
    out = {"stats": stats, "moved": farthest(now, start),
           "weights": farthest(now, saved(policy.rank, latest(after)))}
    if "critic" in others:
        critic = others["critic"].rank
        out["critic_weights"] = farthest(weights(critic), saved(critic, latest(after / "critic")))
    return out


def on_rank(rank: int, world: int, port: int, b: Bundle, results=None) -> dict | None:
    """One process of the replay: join the group, recompute; rank 0's result (also to
    `results`, a queue, when given)."""
    hf_logging.set_verbosity_error()  # (a critic's "newly initialized" head: it is in before/)
    hf_logging.disable_progress_bar()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        out = recompute(b)
    finally:
        dist.destroy_process_group()
    if rank == 0 and results is not None:
        results.put(out)
    return out if rank == 0 else None


def rerun(b: Bundle, ranks: int = 0) -> dict:
    """Recompute the bundle's step on `ranks` processes (0: the run's count); rank 0's result."""
    world = ranks or b.meta["ranks"]
    if world == 1:
        return on_rank(0, 1, free_port(), b)
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(on_rank, (world, free_port(), b, results), nprocs=world)
    return results.get()


def compare(b: Bundle, result: dict, tolerance: float) -> tuple[list[str], bool]:
    """The report's lines (recorded vs replayed) and whether every difference is within
    `tolerance`."""
    lines, ok = [f"{'':<16}{'recorded':>24}{'replayed':>24}{'|Δ|':>12}"], True
    for k in COMPARED:
        if k in b.meta["outcome"]:
            x, y = b.meta["outcome"][k], result["stats"].get(k, float("nan"))
            ok = ok and abs(x - y) <= tolerance
            lines.append(f"{k:<16}{x:>24.17g}{y:>24.17g}{abs(x - y):>12.3g}")
    ok = ok and result["weights"] <= tolerance
    lines.append(f"{'weights':<16}max |Δ| {result['weights']:.3g} from after/ (the update moved "
                 f"them up to {result['moved']:.3g})")
    if "critic_weights" in result:
        ok = ok and result["critic_weights"] <= tolerance
        lines.append(f"{'critic weights':<16}max |Δ| {result['critic_weights']:.3g} from "
                     "after/critic/")
    return lines, ok
