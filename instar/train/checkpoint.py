"""Distributed checkpoints of the FSDP2 trainer: the sharded model and optimizer through
torch.distributed.checkpoint (DCP, each rank writes its own shards; nothing is gathered),
the caller's small `state`, and each rank's RNG states.

    root/
      step-00000004/   .metadata, __R_0.distcp (DCP), state.pt (rank 0), rng-R.pt (rank R)
      step-00000006/
      latest           "step-00000006"
      .tmp-step-...    a save in progress (or one that crashed; removed by the next save)

Every rank of the group calls `save` and `load`. A save is written into a temporary folder
and renamed into place only once complete; `latest` then moves, also by a rename. A crash at
any point leaves the previous checkpoint, and `latest` pointing to it, as they were.
"""

import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)


def rng_state() -> dict:
    """This process's RNG states (python `random`, torch CPU and CUDA), for `torch.save`."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # (a GPU run's, replayed on a CPU)
        torch.cuda.set_rng_state_all(state["cuda"])


def trained_state_dict(model, optimizer) -> tuple[dict, dict]:
    """The model's trained weights (sharded) and the optimizer's state. Frozen weights (a LoRA
    base, --train.freeze, a tied embedding's second name) are left out: they are the starting
    checkpoint's, which the trainer loads before it resumes."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in trained}, optim_sd


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Rename away first, so that no `step-*` folder is ever half deleted."""
    trash = path.with_name(f".tmp-old-{path.name}")
    os.replace(path, trash)
    shutil.rmtree(trash)


def replace_folder(new: Path, folder: Path) -> None:
    """Move the complete folder `new` to `folder`; one already there (a resumed run's earlier
    export) is renamed aside first and deleted after."""
    old = folder.with_name(f".tmp-old-{folder.name}")
    if folder.exists():
        os.replace(folder, old)
    os.replace(new, folder)
    shutil.rmtree(old, ignore_errors=True)


def save(root: Path, step: int, model, optimizer, state: dict, keep: int) -> Path:
    """Write `root/step-{step:08d}`, point `root/latest` at it and keep the newest `keep`.

    `state` (scheduler, data position, ...: plain values and tensors) is written by rank 0;
    each rank's `rng_state()` is saved too, and `load` restores it.
    """
    assert keep >= 1, keep
    rank, final, tmp = dist.get_rank(), root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    if rank == 0:
        for stale in root.glob(".tmp-*"):  # left by a save that crashed
            shutil.rmtree(stale)
        tmp.mkdir(parents=True)
        torch.save(state, tmp / "state.pt")
    dist.barrier()
    model_sd, optim_sd = trained_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    torch.save(rng_state(), tmp / f"rng-{rank}.pt")
    dist.barrier()
    if rank == 0:
        for f in [*tmp.iterdir(), tmp]:
            _fsync(f)
        if final.exists():  # left by a save that crashed before `latest` moved
            _remove(final)
        os.replace(tmp, final)
        pointer = root / ".latest.tmp"
        pointer.write_text(final.name)
        _fsync(pointer)
        os.replace(pointer, root / "latest")
        _fsync(root)
        for old in sorted(root.glob("step-*"), key=lambda p: (p == final, p.name))[:-keep]:
            _remove(old)  # the new one sorts last, so it always stays
    dist.barrier()
    return final


def latest(root: Path) -> Path | None:
    """The checkpoint `root/latest` names; failing that the newest `step-*` (each is complete,
    since it arrived by a rename); None if there is none."""
    pointer = root / "latest"
    if pointer.exists() and (path := root / pointer.read_text().strip()).is_dir():
        return path
    steps = sorted(root.glob("step-*"))
    return steps[-1] if steps else None


def load(path: Path, model, optimizer) -> dict:
    """Restore the model, the optimizer and this rank's RNG in place; return the `state`."""
    model_sd, optim_sd = trained_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                   options=StateDictOptions(strict=False))
    # (not strict: the frozen weights are left out; `dcp.load` fails if a trained one is missing)
    rng = path / f"rng-{dist.get_rank()}.pt"
    if rng.exists():  # absent for ranks beyond the world size that saved
        set_rng_state(torch.load(rng))
    return torch.load(path / "state.pt")


def export_hf(base: Path, out: Path, write_weights) -> None:
    """Write a Hugging Face folder `out`, atomically: the files of `base` (config, tokenizer)
    with the weights `write_weights(path)` writes as model.safetensors. Readable by others:
    files 0o644, folders 0o755 (the temporary ones are made private)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    for f in base.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, tmp / f.name)
    write_weights(str(tmp / "model.safetensors"))
    for path in (tmp, *tmp.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    replace_folder(tmp, out)
