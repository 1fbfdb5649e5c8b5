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
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from instar.train.losses import pg_clip_loss, sft_loss, token_logprobs


@dataclass(frozen=True, slots=True)
class Sequence:
    """One training sequence as the trainer needs it (built from a Sample)."""

    tokens: list[int]
    mask: list[bool]
    old_logprobs: list[float]
    """Behaviour log-probs; 0.0 where `mask` is False (and unused for SFT)."""
    advantage: float = 0.0


def shard(seqs: list[Sequence], world: int, micro_batch: int) -> list[list[list[Sequence]]]:
    """Split into [rank][micro-batch][sequence], with the same micro-batch count on every rank.

    A rank with nothing left gets an empty micro-batch; it still runs a forward and backward
    so FSDP2's collectives line up.
    """
    per_rank = [seqs[r::world] for r in range(world)]
    n_micro = max(1, -(-max(len(p) for p in per_rank) // micro_batch))
    return [[p[i * micro_batch:(i + 1) * micro_batch] for i in range(n_micro)] for p in per_rank]


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
    """Ray actor: holds one rank's shard of the policy and its optimizer."""

    def __init__(self, rank: int, world: int, master: str, model_path: str, *, device: str,
                 dtype: str, threads: int, lr: float, weight_decay: float,
                 freeze: tuple[str, ...] = ()):
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                init_method=f"tcp://{master}", rank=rank, world_size=world)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        model.to(self.device)
        for name, p in model.named_parameters():
            if any(re.search(pattern, name) for pattern in freeze):
                p.requires_grad_(False)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        self.model = model
        self.tied = model.config.tie_word_embeddings
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)
        # Engines start from the same checkpoint, so only what training changes is synced.
        changing = {sync_unit(n) for n, p in model.named_parameters() if p.requires_grad}
        self.sync_names = [n for n in model.state_dict() if sync_unit(n) in changing
                           and not (self.tied and n == "lm_head.weight")]

    def _batch(self, seqs: list[Sequence]):
        if not seqs:  # keeps collectives in step; contributes nothing to the loss
            seqs = [Sequence(tokens=[0, 0], mask=[False, False], old_logprobs=[0.0, 0.0])]
        T = max(len(s.tokens) for s in seqs)
        pad = lambda xs, v: [x + [v] * (T - len(x)) for x in xs]  # noqa: E731
        to = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)  # noqa: E731
        return (to(pad([s.tokens for s in seqs], 0), torch.long),
                to(pad([s.mask for s in seqs], False), torch.float32),
                to(pad([s.old_logprobs for s in seqs], 0.0), torch.float32),
                to([s.advantage for s in seqs], torch.float32),
                to(pad([[1] * len(s.tokens) for s in seqs], 0), torch.long))

    def train_step(self, micro_batches: list[list[Sequence]], loss: str, num_tokens: int,
                   temperature: float, clip_low: float, clip_high: float, lr: float,
                   grad_clip: float) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns token-summed stats."""
        self.model.train()
        for group in self.opt.param_groups:
            group["lr"] = lr
        totals: dict[str, float] = {"loss": 0.0}
        for seqs in micro_batches:
            ids_BT, mask_BT, old_BT, adv_B, attn_BT = self._batch(seqs)
            logits = self.model(input_ids=ids_BT, attention_mask=attn_BT).logits
            logprobs_BT = token_logprobs(logits, ids_BT, temperature)
            if loss == "pg":
                value, stats = pg_clip_loss(logprobs_BT, old_BT, adv_B, mask_BT,
                                            clip_low, clip_high, num_tokens)
            else:
                value, stats = sft_loss(logprobs_BT, mask_BT, num_tokens)
            (value * self.world).backward()
            totals["loss"] += value.item()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              grad_clip if grad_clip > 0 else float("inf"))
        totals["grad_norm"] = norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return totals

    @torch.no_grad()
    def logprobs(self, micro_batches: list[list[Sequence]], temperature: float) -> list[list[float]]:
        """Per-token log-probs of this rank's sequences under the current weights."""
        self.model.eval()
        out = []
        for seqs in micro_batches:
            ids_BT, _, _, _, attn_BT = self._batch(seqs)
            logits = self.model(input_ids=ids_BT, attention_mask=attn_BT).logits
            logprobs_BT = token_logprobs(logits, ids_BT, temperature).cpu()
            out += [logprobs_BT[i, :len(s.tokens)].tolist() for i, s in enumerate(seqs)]
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
