"""One FSDP2 training rank in a Ray actor (gloo on CPU, nccl on GPU).

Each rank gets the same number of micro-batches (see `shard`), so the collectives of
FSDP2's forward and backward stay in step; gradients are averaged over ranks by FSDP2,
and each rank scales its loss by the world size so the result is a global token mean.
"""

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from instar.config import AlgoConfig
from instar.train import checkpoint
from instar.train.losses import policy_loss, sft_loss, token_logprobs, token_mean, value_loss


@dataclass(frozen=True, slots=True)
class Sequence:
    """One training sequence as the trainer needs it (built from a Sample). Per-token lists
    have the length of `tokens` and hold 0.0 where `mask` is False."""

    tokens: list[int]
    mask: list[bool]
    old_logprobs: list[float]
    """Behaviour log-probs: the engine's (unused for SFT)."""
    advantages: list[float] | None = None
    trainer_logprobs: list[float] | None = None
    """The trainer's log-probs before the update (off-policy correction)."""
    ref_logprobs: list[float] | None = None
    """A frozen reference model's log-probs (KL as a loss term)."""
    returns: list[float] | None = None
    """Value targets (critic)."""
    old_values: list[float] | None = None
    """The critic's values before the update (value clipping)."""


PER_TOKEN = ("old_logprobs", "advantages", "trainer_logprobs", "ref_logprobs", "returns",
             "old_values")
EMPTY = Sequence([0, 0], [False, False], *[[0.0, 0.0]] * len(PER_TOKEN))
"""Stands in for a rank's empty micro-batch: keeps collectives in step, adds no loss."""


def shard(seqs: list[Sequence], world: int, budget: int) -> list[list[list[Sequence]]]:
    """Split into [rank][micro-batch][sequence]: rank r takes every world-th sequence, and packs
    them, in order, into micro-batches of at most `budget` padded tokens (a longer sequence
    goes alone). Every rank gets the same number of micro-batches, padded with empty ones
    that still run a forward and backward, so FSDP2's collectives line up. Callers sort by
    length first, so padding stays small and ranks get similar loads."""
    per_rank = []
    for r in range(world):
        batches: list[list[Sequence]] = [[]]
        for s in seqs[r::world]:
            longest = max([len(x.tokens) for x in batches[-1]] + [len(s.tokens)])
            if batches[-1] and longest * (len(batches[-1]) + 1) > budget:
                batches.append([])
            batches[-1].append(s)
        per_rank.append(batches)
    n = max(len(b) for b in per_rank)
    return [b + [[] for _ in range(n - len(b))] for b in per_rank]


def sync_unit(name: str) -> str:
    """Tensors that vLLM may fuse into one module (q/k/v, gate/up, all experts) belong to one
    decoder layer, so a layer is synced whole or not at all; other tensors on their own."""
    layer = re.match(r".*?\.\d+\.", name)
    return layer.group(0) if layer else name


def atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    save_file(tensors, tmp)
    os.replace(tmp, path)


class TrainWorker:
    """Ray actor: holds one rank's shard of a model and its optimizer. `head="value"` makes
    it a critic (one value per token); with every parameter frozen it is a reference or a
    teacher (log-probs only, no optimizer)."""

    def __init__(self, rank: int, world: int, master: str, model_path: str, *, device: str,
                 dtype: str, threads: int, lr: float, weight_decay: float,
                 freeze: tuple[str, ...] = (), head: str = "lm",
                 activation_checkpointing: bool = False, cpu_offload: bool = False):
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                init_method=f"tcp://{master}", rank=rank, world_size=world)
        auto = AutoModelForCausalLM if head == "lm" else AutoModelForTokenClassification
        model = auto.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                     **({} if head == "lm" else {"num_labels": 1}))
        model.to(self.device)
        for name, p in model.named_parameters():
            if any(re.search(pattern, name) for pattern in freeze):
                p.requires_grad_(False)
        if activation_checkpointing:  # recompute each decoder layer in the backward
            model.gradient_checkpointing_enable({"use_reentrant": False})
        offload = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
        for layer in model.model.layers:
            fully_shard(layer, **offload)
        fully_shard(model, **offload)
        self.model, self.head = model, head
        self.tied = model.config.tie_word_embeddings
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay) if trainable else None
        # Engines start from the same checkpoint, so only what training changes is synced.
        changing = {sync_unit(n) for n, p in model.named_parameters() if p.requires_grad}
        self.sync_names = [n for n in model.state_dict() if sync_unit(n) in changing
                           and not (self.tied and n == "lm_head.weight")]

    def _batch(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        """Right-padded tensors: tokens, attn, mask and each per-token field the sequences have."""
        seqs = seqs or [EMPTY]
        T = max(len(s.tokens) for s in seqs)

        def column(rows, dtype):
            return torch.tensor([r + [0] * (T - len(r)) for r in rows], dtype=dtype,
                                device=self.device)
        b = {"tokens": column([s.tokens for s in seqs], torch.long),
             "attn": column([[1] * len(s.tokens) for s in seqs], torch.long),
             "mask": column([s.mask for s in seqs], torch.float32)}
        for name in PER_TOKEN:
            if getattr(seqs[0], name) is not None:
                b[name] = column([getattr(s, name) for s in seqs], torch.float32)
        return b

    def _forward(self, b: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """Log-probs of the tokens (policy) or values (critic), [B, T]."""
        logits = self.model(input_ids=b["tokens"], attention_mask=b["attn"]).logits
        return logits[..., 0] if self.head == "value" else token_logprobs(logits, b["tokens"],
                                                                          temperature)

    def train_step(self, micro_batches: list[list[Sequence]], loss: str, algo: AlgoConfig,
                   num_tokens: int, num_seqs: int, temperature: float, lr: float,
                   grad_clip: float) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches. `loss`: "pg" (the policy loss
        `algo` describes), "sft" or "value" (critic). Returns this rank's shares of the step's
        loss and stats: summed over ranks they are the step's values."""
        self.model.train()
        for group in self.opt.param_groups:
            group["lr"] = lr
        totals: dict[str, float] = {"loss": 0.0}
        for i, seqs in enumerate(micro_batches):
            # gradients accumulate unsharded; they are reduce-scattered once, after the last
            self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            b = self._batch(seqs)
            out_BT = self._forward(b, temperature)
            if loss == "pg":
                value, stats = policy_loss(out_BT, b, algo, num_tokens, num_seqs)
            elif loss == "sft":
                value, stats = sft_loss(out_BT, b["mask"], num_tokens)
            else:
                value, stats = token_mean(value_loss(out_BT, b["old_values"], b["returns"],
                                                     algo.value_clip), b["mask"], num_tokens), {}
            (value * self.world).backward()  # FSDP2 averages gradients over ranks
            totals["loss"] += value.item()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                                              grad_clip if grad_clip > 0 else float("inf"))
        totals["grad_norm"] = norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return totals

    @torch.no_grad()
    def score(self, micro_batches: list[list[Sequence]], temperature: float) -> list[list[float]]:
        """Per-token log-probs (policy) or values (critic) of this rank's sequences."""
        self.model.eval()
        out = []
        for seqs in micro_batches:
            out_BT = self._forward(self._batch(seqs), temperature).float().cpu()
            out += [out_BT[i, :len(s.tokens)].tolist() for i, s in enumerate(seqs)]
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gather the unsharded weights (every rank must call); rank 0 gets them, on CPU."""
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
        if self.rank != 0:
            return None
        if self.tied:
            sd.pop("lm_head.weight", None)
        return {k: v.contiguous() for k, v in sd.items()}

    def save_weights(self, path: str) -> None:
        """Write the full weights as one safetensors file (rank 0), atomically."""
        sd = self.full_state_dict()
        if sd is not None:
            atomic_save(sd, Path(path))

    def save_shard(self, folder: str) -> str:
        """Write this rank's shards of the synced tensors to folder/rank-R.safetensors, with no
        collective: concatenated over ranks (dim 0, in rank order) they are the full tensors."""
        sd, out = self.model.state_dict(), {}
        for name in self.sync_names:
            t = sd[name]
            if isinstance(t, DTensor):
                out[name] = t.to_local().detach().cpu().contiguous()
            elif self.rank == 0:
                out[name] = t.detach().cpu().contiguous()
        path = Path(folder) / f"rank-{self.rank}.safetensors"
        atomic_save(out, path)
        return str(path)

    def save_checkpoint(self, root: str, step: int, state: dict, keep: int) -> str:
        """Model, optimizer, RNG and the caller's `state`, sharded, atomically (every rank)."""
        return str(checkpoint.save(Path(root), step, self.model, self.opt, state, keep))

    def load_checkpoint(self, path: str) -> dict:
        return checkpoint.load(Path(path), self.model, self.opt)

    def connect(self, engines: list, transport: str) -> None:
        """GPU transports through vLLM's weight-transfer engines, one per inference engine:
        "nccl" (engines on other GPUs: a broadcast group of this rank and the engine) or
        "ipc" (an engine on this GPU: CUDA IPC handles). Every rank takes part, since
        gathering a full tensor is a collective; rank 0 sends."""
        from vllm.distributed.weight_transfer import (
            ModuleSource,
            RayVLLMWeightSyncClient,
            WeightTransferTrainerFactory,
        )
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        from vllm.utils.network_utils import get_ip, get_open_port

        torch.cuda.set_device(self.device)
        self.transfers = []
        for engine in engines:  # engines run with tensor parallel 1: a group of two
            info = (NCCLTrainerInitInfo(master_address=get_ip(), master_port=get_open_port(),
                                        world_size=2, rank=self.rank) if transport == "nccl"
                    else IPCTrainerInitInfo(rank=self.rank))
            self.transfers.append(WeightTransferTrainerFactory.trainer_init(
                info, client=RayVLLMWeightSyncClient(engine), source=ModuleSource(self.model)))

    @torch.no_grad()
    def send_weights(self) -> None:
        for transfer in self.transfers:
            transfer.send_weights()

    def shutdown(self) -> None:
        dist.destroy_process_group()
