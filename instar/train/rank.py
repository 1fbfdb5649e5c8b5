"""One FSDP2 training rank: the code every rank of a trainer runs (gloo on CPU, nccl on GPU).

Nothing here imports Ray. A rank joins a process group set up by its launcher, builds its
shard of the model and runs steps: under Ray each rank is an actor (instar/train/trainer.py);
under `torchrun`, or as a group of one in a plain process, `join()` sets the group up.

    join("cuda")                                  # RANK, WORLD_SIZE, MASTER_ADDR from torchrun
    rank = Rank(model_path, device="cuda", dtype="bfloat16", lr=1e-5)
    rank.train_step(micro_batches, "pg", algo, num_tokens, num_seqs, temperature, lr, grad_clip)

Each rank gets the same number of micro-batches (see `shard`), so the collectives of
FSDP2's forward and backward stay in step; gradients are averaged over ranks by FSDP2,
and each rank scales its loss by the world size so the result is a global token mean.

Precision: the ranks hold their shards, gradients and AdamW states in `master_dtype`
(float32 by default) and compute in the model's `dtype`: FSDP2 casts each layer's gathered
weights to `dtype` for the forward and backward and reduces gradients in float32. What goes
to the engines (`save_shard`, `full_state_dict`, the GPU transports) is cast to `dtype`.

Vision-language models (Qwen-VL): a sequence's `images` (data URLs, one per expanded run of
placeholders in its tokens) go through the model's own image processor, as in the engine, and
the forward gets their `pixel_values` and `image_grid_thw`.
"""

import dataclasses
import os
import re
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForTokenClassification,
)

from instar.agents.images import decode
from instar.config import AlgoConfig, LoraConfig
from instar.train import checkpoint
from instar.train import lora as adapters
from instar.train.batch import EMPTY, PER_TOKEN, Sequence
from instar.train.losses import (
    combine,
    policy_loss,
    sft_loss,
    token_logprobs,
    token_mean,
    value_loss,
)
from instar.train.routing import RoutingReplay


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


def engine_source(model: torch.nn.Module, dtype: torch.dtype):
    """The model's weights for vLLM's weight-transfer engines, cast to the engines' dtype."""
    from vllm.distributed.weight_transfer import ModuleSource

    class Cast(ModuleSource):
        def metadata(self):
            return [dataclasses.replace(m, dtype=dtype) for m in super().metadata()]

        def __iter__(self):
            return ((name, t.to(dtype)) for name, t in super().__iter__())
    return Cast(model)


def free_port() -> int:
    """A TCP port free on this host now (for a group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(device: str) -> None:
    """Join the process group `torchrun` describes in the environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); a plain process becomes a group of one."""
    backend = "nccl" if device == "cuda" else "gloo"
    if "MASTER_PORT" in os.environ:
        return dist.init_process_group(backend)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)


class Rank:
    """One rank's shard of a model and its optimizer; the process group must be up.
    `head="value"` makes it a critic (one value per token); with every parameter frozen it
    is a reference or a teacher (log-probs only, no optimizer). With `lora` (rank > 0) only
    a LoRA adapter trains, on the frozen base, and only the adapter goes to the engines."""

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32",
                 threads: int = 1, lr: float = 1e-3, weight_decay: float = 0.0,
                 freeze: tuple[str, ...] = (), head: str = "lm",
                 activation_checkpointing: bool = False, cpu_offload: bool = False,
                 master_dtype: str = "float32", routing_replay: bool = False, seed: int = 0,
                 lora: LoraConfig | None = None, adapter_names: tuple[str, ...] = ("default",)):
        torch.set_num_threads(threads)
        torch.manual_seed(seed)  # what the checkpoint lacks (a critic's value head) starts alike
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
            if device == "cuda" else torch.device("cpu")
        config = AutoConfig.from_pretrained(model_path)
        vision = hasattr(config, "vision_config")
        auto = AutoModelForTokenClassification if head != "lm" else \
            AutoModelForImageTextToText if vision else AutoModelForCausalLM
        self.image_processor = AutoImageProcessor.from_pretrained(model_path) if vision else None
        self.image_token = getattr(config, "image_token_id", None)
        self.dtype = getattr(torch, dtype)  # compute, and what the engines load
        if head != "lm":  # a critic: one value per token, its head without dropout
            config.num_labels, config.classifier_dropout = 1, 0.0
        model = auto.from_pretrained(model_path, config=config, dtype=getattr(torch, master_dtype))
        model.to(self.device)
        for name, p in model.named_parameters():
            if any(re.search(pattern, name) for pattern in freeze):
                p.requires_grad_(False)
        self.lora = lora if lora and lora.rank else None
        if self.lora:  # (before sharding: PEFT swaps the target modules for adapted ones)
            model = adapters.wrap(model, lora, adapter_names)
        inner = model.get_base_model() if self.lora else model
        if activation_checkpointing:  # recompute each decoder layer in the backward
            model.gradient_checkpointing_enable({"use_reentrant": False})
        # MoE: each router's top-k replays the engine's recorded choices, when a batch has them
        self.replay = RoutingReplay(model) if routing_replay else None
        offload = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
        mixed = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        # CPU (memory to spare, slow gloo collectives): a training step gathers each layer once
        # and keeps it through all its micro-batches' forwards and backwards, then
        # reduce-scatters the summed gradients once. GPUs: FSDP2's memory-lean defaults, one
        # layer unsharded at a time and gradients reduce-scattered after every micro-batch.
        self.gather_once = self.device.type == "cpu"
        for layer in getattr(inner.model, "language_model", inner.model).layers:
            fully_shard(layer, mp_policy=mixed, reshard_after_forward=not self.gather_once,
                        **offload)
        fully_shard(model, mp_policy=mixed, **offload)
        self.model, self.head = model, head
        self.tied = model.config.tie_word_embeddings
        if self.lora:  # each adapter: its own optimizer and synced tensors (`use` picks one)
            self.owned = {name: [n for n, _ in model.named_parameters() if adapters.owns(n, name)]
                          for name in adapter_names}
            params = dict(model.named_parameters())
            self.opts = {name: torch.optim.AdamW([params[n] for n in ns], lr=lr,
                                                 weight_decay=weight_decay)
                         for name, ns in self.owned.items()}
            self.active = ""
            self.use(adapter_names[0])
        else:
            trainable = [p for p in model.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay) \
                if trainable else None
            # Engines start from the same checkpoint, so only what training changes is synced.
            changing = {sync_unit(n) for n, p in model.named_parameters() if p.requires_grad}
            self.sync_names = [n for n in model.state_dict() if sync_unit(n) in changing
                               and not (self.tied and n == "lm_head.weight")]

    def use(self, adapter: str) -> None:
        """Multi-LoRA: the calls that follow train, score, send and checkpoint `adapter` (the
        others stay as they are: PEFT runs only the active adapter and lets only it learn)."""
        if adapter != self.active:  # (sharded first: FSDP2 takes requires_grad from the shards)
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
            self.model.base_model.set_adapter(adapter)
            self.active, self.opt, self.sync_names = adapter, self.opts[adapter], self.owned[adapter]

    def _batch(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        """Right-padded tensors: tokens, attn, mask and each per-token field the sequences have."""
        seqs = seqs or [EMPTY]
        T = max(len(s.tokens) for s in seqs)

        def column(rows, dtype, pad=0):
            return torch.tensor([r + [pad] * (T - len(r)) for r in rows], dtype=dtype,
                                device=self.device)
        b = {"tokens": column([s.tokens for s in seqs], torch.long),
             "attn": column([[1] * len(s.tokens) for s in seqs], torch.long),
             "mask": column([s.mask for s in seqs], torch.float32)}
        for name in PER_TOKEN:
            if getattr(seqs[0], name) is not None:
                b[name] = column([getattr(s, name) for s in seqs], torch.float32)
        if urls := [u for s in seqs for u in s.images or ()]:  # in the order of the placeholders
            pixels = self.image_processor(images=[decode(u) for u in urls], return_tensors="pt")
            b["pixel_values"] = pixels["pixel_values"].to(self.device)
            b["image_grid_thw"] = pixels["image_grid_thw"].to(self.device)
        if self.replay and all(s.routed_experts is not None for s in seqs):
            b["routed_experts"] = column([s.routed_experts for s in seqs], torch.long,
                                         pad=seqs[0].routed_experts[0])  # padding: any row
        return b

    def _forward(self, b: dict[str, torch.Tensor], temperature: float, entropy: bool = False):
        """Log-probs of the tokens (policy) or values (critic), [B, T], in float32; with
        `entropy`, (log-probs, entropies)."""
        if self.replay:  # kept until the next forward: recomputed layers replay it too
            self.replay.use(b.get("routed_experts"))
        images = {} if "pixel_values" not in b else dict(
            pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"],
            mm_token_type_ids=(b["tokens"] == self.image_token).long())  # (for M-RoPE)
        logits = self.model(input_ids=b["tokens"], attention_mask=b["attn"], **images).logits
        return logits[..., 0].float() if self.head == "value" else token_logprobs(
            logits, b["tokens"], temperature, entropy)

    def train_step(self, micro_batches: list[list[Sequence]], loss: str, algo: AlgoConfig,
                   num_tokens: int, num_seqs: int, temperature: float, lr: float,
                   grad_clip: float) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches. `loss`: "pg" (the policy loss
        `algo` describes), "sft" or "value" (critic). Returns this rank's shares of the step's
        loss and stats: summed over ranks they are the step's values."""
        self.model.train()
        for group in self.opt.param_groups:
            group["lr"] = lr
        totals: dict[str, float] = {}
        for i, seqs in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            self.model.set_requires_gradient_sync(last or not self.gather_once)
            self.model.set_reshard_after_backward(last or not self.gather_once)
            b = self._batch(seqs)
            out_BT = self._forward(b, temperature, entropy=loss == "pg")
            if loss == "pg":
                value, stats = policy_loss(*out_BT, b, algo, num_tokens, num_seqs)
            elif loss == "sft":
                value, stats = sft_loss(out_BT, b["mask"], num_tokens)
            elif loss == "value":
                value, stats = token_mean(value_loss(out_BT, b["old_values"], b["returns"],
                                                     algo.value_clip), b["mask"], num_tokens), {}
            else:
                raise ValueError(f"unknown loss {loss!r}: pg, sft or value")
            (value * self.world).backward()  # FSDP2 averages gradients over ranks
            combine(totals, {"loss": value.item(), **stats})
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
        """Gather the unsharded weights (every rank must call); rank 0 gets them, on CPU, in the
        engines' dtype."""
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
        if self.rank != 0:
            return None
        if self.tied:
            sd.pop("lm_head.weight", None)
        return {k: v.to(self.dtype).contiguous() for k, v in sd.items()}

    def save_weights(self, path: str) -> None:
        """Write the full weights as one safetensors file (rank 0), atomically."""
        sd = self.full_state_dict()
        if sd is not None:
            atomic_save(sd, Path(path))

    def save_shard(self, folder: str) -> str:
        """Write this rank's shards of the synced tensors to folder/rank-R.safetensors, with no
        collective: concatenated over ranks (dim 0, in rank order) they are the full tensors,
        in the engines' dtype."""
        sd, out = self.model.state_dict(), {}
        for name in self.sync_names:
            t = sd[name]
            if isinstance(t, DTensor):
                out[name] = t.to_local().detach().to("cpu", self.dtype).contiguous()
            elif self.rank == 0:
                out[name] = t.detach().to("cpu", self.dtype).contiguous()
        path = Path(folder) / f"rank-{self.rank}.safetensors"
        atomic_save(out, path)
        return str(path)

    def adapter(self) -> dict | None:
        """LoRA: the adapter, whole, in the engines' dtype (see instar/train/lora.py), for
        rank 0; every rank must call (each tensor is gathered)."""
        params = dict(self.model.named_parameters())
        tensors = {adapters.saved_name(n, self.active): (p.full_tensor() if isinstance(p, DTensor)
                                                         else p).detach().to("cpu", self.dtype)
                   .contiguous() for n in self.sync_names for p in [params[n]]}
        return {"config": adapters.adapter_config(self.model, self.active), "tensors": tensors} \
            if self.rank == 0 else None

    def save_checkpoint(self, root: str, step: int, state: dict, keep: int) -> str:
        """Model, optimizer, RNG and the caller's `state`, sharded, atomically (every rank)."""
        return str(checkpoint.save(Path(root), step, self.model, self.opt, state, keep))

    def load_checkpoint(self, path: str) -> dict:
        return checkpoint.load(Path(path), self.model, self.opt)

    def connect(self, engines: list, transport: str, tensor_parallel: int = 1) -> None:
        """Set up the GPU transports (vLLM's weight-transfer engines); `link` then joins each
        engine. Every rank runs them: a full tensor is gathered by all (FSDP2's
        `full_tensor()`), and rank 0 alone sends it (vLLM's `is_sender`).

        "nccl" (engines on GPUs of their own): rank 0 forms one broadcast group with each
        engine, of 1 + `tensor_parallel` members (rank 0 as 0, then the engine's TP workers,
        each loading the full tensors it gets). One group per engine: vLLM places every
        engine's workers from rank 1, so engines cannot share a group; each send gathers the
        weights again. The other ranks are in no group: they only join the gathers.
        "ipc" (engine i on rank i's GPU): every rank exports a CUDA IPC handle of its own
        gathered copy; rank 0 ships them all, and each engine opens the one of its device. So
        one send serves every engine, and an engine with no rank on its GPU gets nothing."""
        torch.cuda.set_device(self.device)
        self.engines, self.transport, self.tensor_parallel = engines, transport, tensor_parallel
        self.source = engine_source(self.model, self.dtype)
        self.transfers: dict[int, object] = {}
        self.everyone = self._transfer(engines) if transport == "ipc" else None

    def _transfer(self, engines: list):
        from vllm.distributed.weight_transfer import (
            RayVLLMWeightSyncClient,
            WeightTransferTrainerFactory,
        )
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        from vllm.utils.network_utils import get_ip, get_open_port

        if self.transport == "ipc":
            info = IPCTrainerInitInfo(rank=self.rank)
        else:  # (the address is rank 0's, the one member of the group on the trainer's side)
            info = NCCLTrainerInitInfo(master_address=get_ip(), world_size=1 + self.tensor_parallel,
                                       master_port=get_open_port() if self.rank == 0 else 0,
                                       rank=self.rank)
        return WeightTransferTrainerFactory.trainer_init(
            info, client=RayVLLMWeightSyncClient(engines), source=self.source)

    def link(self, engine: int) -> None:
        """Join engine `engine` (again, after Ray restarted it: its old group died with it)."""
        if old := self.transfers.pop(engine, None):
            old.shutdown()
        self.transfers[engine] = self._transfer([self.engines[engine]])

    @torch.no_grad()
    def send_weights(self, engine: int | None = None) -> int:
        """The weights to every engine, or to `engine` only (every rank calls); the bytes
        each engine gets."""
        if engine is not None:
            self.transfers[engine].send_weights()
        elif self.everyone is not None:
            self.everyone.send_weights()
        else:
            for i in sorted(self.transfers):  # (in one order on every rank: they gather)
                self.transfers[i].send_weights()
        return sum(t.numel() for t in self.model.state_dict().values()) * self.dtype.itemsize

    def shutdown(self) -> None:
        dist.destroy_process_group()
