"""Distributed checkpoints on the real stack: 2 gloo ranks, FSDP2, the built-in tiny model.

One run trains 2 steps (saving after each), records 3 more steps, then dies in the middle of
a third save. Fresh processes resume from `latest` and must repeat those 3 steps exactly.
"""

import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.multiprocessing.spawn import ProcessException
from transformers import AutoModelForCausalLM

from instar.train import checkpoint

pytestmark = pytest.mark.stack


def rank_main(rank: int, port: int, model_path: Path, root: Path, phase: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=2, timeout=timedelta(seconds=60))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> float:
        ids_BT = torch.randint(0, model.config.vocab_size, (2, 16))  # from the restored RNG
        loss = model(input_ids=ids_BT, labels=ids_BT).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    if phase == "first":
        torch.manual_seed(rank)
        for s in (1, 2):
            step()
            checkpoint.save(root, s, model, opt, {"step": s}, keep=2)
        losses = [step() for _ in range(3)]
    else:
        torch.manual_seed(1000 + rank)  # differs from the first run: only the restore matches
        assert checkpoint.load(checkpoint.latest(root), model, opt) == {"step": 2}
        losses = [step() for _ in range(3)]
    (root / f"losses-{phase}-{rank}.json").write_text(json.dumps(losses))
    if phase == "first" and rank == 0:
        os.replace = lambda *args: os._exit(1)  # killed after writing, before the rename
    checkpoint.save(root, 5, model, opt, {"step": 5}, keep=2)
    dist.destroy_process_group()


def spawn(model_path: Path, root: Path, phase: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, model_path, root, phase), nprocs=2)


def test_resume_is_exact_and_a_crashed_save_leaves_the_previous(tiny_model, tmp_path):
    with pytest.raises(ProcessException):  # rank 0 died; rank 1 errs or is ended
        spawn(tiny_model, tmp_path, "first")
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == [".tmp-step-00000005", "step-00000001", "step-00000002"]
    assert (tmp_path / "latest").read_text() == "step-00000002"
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000002"

    spawn(tiny_model, tmp_path, "resume")
    for rank in (0, 1):
        first, resumed = (json.loads((tmp_path / f"losses-{p}-{rank}.json").read_text())
                          for p in ("first", "resume"))
        assert resumed == first
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["step-00000002", "step-00000005"]  # keep=2; the crashed save cleaned up
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000005"
