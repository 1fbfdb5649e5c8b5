"""A trainer: a group of FSDP2 ranks holding one model, each rank a Ray actor placed anywhere
in the cluster. The driver calls the group; every call goes to all of its ranks.

    trainer = Trainer(cfg, model_path)              # the policy
    trainer.step(seqs, "pg", lr)                    # one optimizer step over every rank
    trainer.score(seqs, temperature)                # per-token log-probs, in order

What a rank runs is instar/train/rank.py, which needs no Ray; the actor, `TrainWorker`, only
adds the rendezvous of the group through Ray (see instar/cluster.py).

Two threads call the policy's trainer: the loop, and with a GPU transport the router, to give
an engine Ray restarted the current weights (`resend`). The ranks' calls are collectives, so
every rank must get them in one order: each call reaches all ranks under one lock.
"""

import copy
import os
import threading
from pathlib import Path

import ray
import torch
from ray.util.queue import Queue

from instar.cluster import init_process_group, rendezvous
from instar.config import AlgoConfig, Config
from instar.train import checkpoint, lora
from instar.train.batch import Sequence, split, unsplit
from instar.train.losses import combine
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


def rank_options(cfg: Config, head: str = "lm", frozen: bool = False,
                 lr: float | None = None) -> dict:
    """The keyword arguments of each `Rank` of a trainer (see `Trainer`)."""
    t = cfg.train
    return dict(device=cfg.cluster.device, dtype=cfg.model.dtype, threads=t.threads_per_rank,
                lr=lr or t.lr, weight_decay=t.weight_decay,
                freeze=(".*",) if frozen else tuple(t.freeze), head=head,
                activation_checkpointing=t.activation_checkpointing, cpu_offload=t.cpu_offload,
                master_dtype=cfg.model.dtype if frozen else t.master_dtype,
                routing_replay=t.routing_replay and head == "lm" and not frozen,
                seed=cfg.data.seed, lora=cfg.lora if head == "lm" and not frozen else None,
                adapter_names=tuple(a.name for a in cfg.lora.adapters) or ("default",))


def merged(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """A step's loss and stats from each rank's shares (the grad norm: the same on every rank)."""
    out: dict[str, float] = {}
    for r in per_rank:
        combine(out, r)
    out["grad_norm"] = per_rank[0]["grad_norm"]
    return out


class Trainer:
    """The policy, or a critic (`head="value"`), or a frozen reference or teacher
    (`frozen=True`): `--train.num-ranks` ranks of one model."""

    def __init__(self, cfg: Config, model_path: str, placement: list[dict] | None = None, *,
                 head: str = "lm", frozen: bool = False, lr: float | None = None):
        t, model_path = cfg.train, os.path.abspath(model_path)  # the ranks' cwd is not ours
        master = rendezvous()  # rank 0 posts its address there, on whichever node it runs
        default = dict(num_cpus=0, num_gpus=1 if cfg.cluster.device == "cuda" else 0)
        options = rank_options(cfg, head, frozen, lr)
        self.lora = bool(options["lora"] and cfg.lora.rank)
        """Only a LoRA adapter trains, and only it goes to the engines (`adapter`)."""
        actor = ray.remote(TrainWorker)
        self.workers = [actor.options(**(placement[r] if placement else default),
                                      runtime_env=RANK_ENV)
                        .remote(r, t.num_ranks, master, model_path, **options)
                        for r in range(t.num_ranks)]
        self.cfg, self.lock = cfg, threading.Lock()
        self.active = ""
        """Multi-LoRA: the adapter every call is on (see `using`); "": the ranks' own."""
        self.linked: dict[int, str] = {}
        """GPU transports: the incarnation of each engine the ranks are linked to."""
        self.sent: int | None = 0
        """GPU transports: the weight version the engines were last sent, while the ranks still
        hold it (None once a step or a checkpoint load changed them). The engines start from
        the ranks' checkpoint: 0."""

    def using(self, adapter: str) -> "Trainer":
        """Multi-LoRA: these ranks, with every call on LoRA adapter `adapter` (its weights, its
        optimizer, its checkpoints). The ranks switch adapter per call, under the one lock."""
        view = copy.copy(self)
        view.active = adapter
        return view

    def _submit(self, method: str, *args, parts: list | None = None) -> list:
        """Call `method` on every rank (rank r's first argument: parts[r], if given); the refs."""
        with self.lock:
            for w in self.workers if self.active else ():  # (Ray runs a caller's calls in order)
                w.use.remote(self.active)
            return [getattr(w, method).remote(*([parts[r]] if parts is not None else []), *args)
                    for r, w in enumerate(self.workers)]

    def _shards(self, seqs: list[Sequence]) -> tuple[list[int], list]:
        return split(seqs, len(self.workers), self.cfg.train.micro_batch_tokens)

    def step(self, seqs: list[Sequence], loss: str, lr: float,
             algo: AlgoConfig | None = None) -> dict[str, float]:
        """One optimizer step on `seqs` (the policy loss: `algo`'s, default the run's); the
        step's loss and stats."""
        c = self.cfg
        num_tokens = sum(sum(s.mask) for s in seqs)
        num_seqs = sum(any(s.mask) for s in seqs)
        self.sent = None
        per_rank = ray.get(self._submit("train_step", loss, algo or c.algo, num_tokens, num_seqs,
                                        c.rollout.temperature, lr, c.train.grad_clip,
                                        parts=self._shards(seqs)[1]))
        return merged(per_rank)

    def score(self, seqs: list[Sequence], temperature: float) -> list[list[float]]:
        """Per-token log-probs (a critic: values) of `seqs`, in order, under the current weights."""
        order, shards = self._shards(seqs)
        return unsplit(order, ray.get(self._submit("score", temperature, parts=shards)))

    def probe(self, ids: list[int]) -> list[float]:
        """Log-probs of one fixed sequence at temperature 1 (the sync fingerprint)."""
        return self.score([Sequence(ids, [True] * len(ids), [0.0] * len(ids))], 1.0)[0]

    def save_shards(self, folder: str) -> list[str]:
        """Each rank writes its shards of the weights that training changes; the files."""
        return ray.get(self._submit("save_shard", folder))

    def adapter(self) -> dict:
        """LoRA: the adapter as it is now (instar/train/lora.py), gathered from the ranks."""
        return ray.get(self._submit("adapter"))[0]

    def save_checkpoint(self, root: Path, step: int, state: dict, keep: int) -> None:
        ray.get(self._submit("save_checkpoint", str(root), step, state, keep))

    def load_checkpoint(self, path: Path) -> dict:
        self.sent = None
        return ray.get(self._submit("load_checkpoint", str(path)))[0]

    def connect(self, engines: list, transport: str) -> None:
        """Link the ranks to `engines` through a GPU transport, "nccl" or "ipc" (see
        `Rank.connect`; ipc: at most one engine per rank, `Config.validate` checks)."""
        ray.get(self._submit("connect", engines, transport, self.cfg.rollout.tensor_parallel))
        self.link(ray.get([e.incarnation.remote() for e in engines]))

    def link(self, incarnations: list[str]) -> None:
        """Link the ranks to every engine whose incarnation (`Engine.incarnation`) is new: at
        the start, and after Ray restarted it."""
        with self.lock:
            refs = [ref for i, inc in enumerate(incarnations) for ref in self._relink(i, inc)]
        ray.get(refs)

    def send_weights(self, version: int) -> int:
        """Send the ranks' weights to every linked engine, as `version`; the bytes each gets."""
        with self.lock:
            self.sent = version
            refs = [w.send_weights.remote() for w in self.workers]
        return ray.get(refs)[0]

    def resend(self, engine: int, incarnation: str, version: int) -> list | None:
        """Send `version` to engine `engine` alone (an engine Ray restarted: it is linked
        first); the refs to wait for. None if the ranks no longer hold `version`: the weights
        changed since (the next sync brings the new ones) or a later sync is under way."""
        with self.lock:
            if self.sent != version:
                return None
            return self._relink(engine, incarnation) + [w.send_weights.remote(engine)
                                                        for w in self.workers]

    def _relink(self, engine: int, incarnation: str) -> list:
        """(Under the lock.) The refs of linking the ranks to `engine`, if it is new."""
        if self.linked.get(engine) == incarnation:
            return []
        self.linked[engine] = incarnation
        return [w.link.remote(engine) for w in self.workers]

    def save_weights(self, path: str) -> None:
        """The full weights in one file (every rank gathers, rank 0 writes)."""
        ray.get(self._submit("save_weights", path))

    def export(self, base: Path, out: Path) -> None:
        """Write an HF folder: the base model's config and tokenizer with the current weights;
        LoRA: a PEFT adapter folder on `base` (and, with --lora.merge, out/merged)."""
        if self.lora:
            return lora.export(self.adapter(), base, out, self.cfg.lora.merge,
                               getattr(torch, self.cfg.model.dtype))
        checkpoint.export_hf(base, out, self.save_weights)

    def shutdown(self) -> None:
        """Leave the process group and end the ranks' actors (their processes with them)."""
        try:
            ray.get(self._submit("shutdown"), timeout=60)
        finally:
            for w in self.workers:
                ray.kill(w)
