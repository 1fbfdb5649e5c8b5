"""A trainer: a group of FSDP2 ranks holding one model, each rank a Ray actor placed anywhere
in the cluster. The driver calls the group; every call goes to all of its ranks.

    trainer = Trainer(cfg, model_path)              # the policy
    trainer.step(seqs, "pg", lr)                    # one optimizer step over every rank
    trainer.score(seqs, temperature)                # per-token log-probs, in order

What a rank runs is instar/train/rank.py, which needs no Ray; the actor, `TrainWorker`, only
adds the rendezvous of the group through Ray (see instar/cluster.py).
"""

import os
from pathlib import Path

import ray
from ray.util.queue import Queue

from instar.cluster import init_process_group, rendezvous
from instar.config import Config
from instar.train import checkpoint
from instar.train.batch import Sequence, shard
from instar.train.rank import Rank

RANK_ENV = {"env_vars": {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**36)}}
"""The ranks' Ray runtime_env. glibc hands large freed blocks back to the OS, so each CPU
training step faulted its activations in again page by page (measured here: ~200k faults
and a third of the forward's time per step); with these, freed memory stays for the next."""


class TrainWorker(Rank):
    """A Rank in a Ray actor: joins its group through the rendezvous queue, then builds."""

    def __init__(self, rank: int, world: int, master: Queue, model_path: str, **options):
        init_process_group(rank, world, master, options["device"])
        super().__init__(model_path, **options)


class Trainer:
    """The policy, or a critic (`head="value"`), or a frozen reference or teacher
    (`frozen=True`): `--train.num-ranks` ranks of one model."""

    def __init__(self, cfg: Config, model_path: str, placement: list[dict] | None = None, *,
                 head: str = "lm", frozen: bool = False, lr: float | None = None):
        t, model_path = cfg.train, os.path.abspath(model_path)  # the ranks' cwd is not ours
        master = rendezvous()  # rank 0 posts its address there, on whichever node it runs
        device = cfg.cluster.device
        default = dict(num_cpus=0, num_gpus=1 if device == "cuda" else 0)
        options = dict(device=device, dtype=cfg.model.dtype, threads=t.threads_per_rank,
                       lr=lr or t.lr, weight_decay=t.weight_decay,
                       freeze=(".*",) if frozen else tuple(t.freeze), head=head,
                       activation_checkpointing=t.activation_checkpointing,
                       cpu_offload=t.cpu_offload,
                       master_dtype=cfg.model.dtype if frozen else t.master_dtype,
                       routing_replay=t.routing_replay and head == "lm" and not frozen)
        actor = ray.remote(TrainWorker)
        self.workers = [actor.options(**(placement[r] if placement else default),
                                      runtime_env=RANK_ENV)
                        .remote(r, t.num_ranks, master, model_path, **options)
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
        checkpoint.export_hf(base, out, self.save_weights)

    def shutdown(self) -> None:
        """Leave the process group and end the ranks' actors (their processes with them)."""
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        finally:
            for w in self.workers:
                ray.kill(w)
