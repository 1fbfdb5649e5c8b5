"""bfloat16 compute with float32 master weights (--train.master-dtype), on one in-process rank
of the real FSDP2 worker: the optimizer holds float32, an update far below bfloat16's
resolution survives where bfloat16 masters round it away, the forward computes what a
bfloat16 model computes, and what goes to the engines is bfloat16."""

import pytest
import torch
from safetensors.torch import load_file

from instar.config import AlgoConfig
from instar.train.batch import Sequence
from instar.train.rank import Rank, engine_source, join

SEQS = [Sequence(list(range(1 + k, 25 + k)), [False] * 4 + [True] * 20, [0.0] * 24)
        for k in range(4)]
PROBE = [Sequence(list(range(30, 50)), [True] * 20, [0.0] * 20)]
LR = 1e-5  # an AdamW first step moves every weight by about lr: below bfloat16's resolution


def one_step(model_path, tmp_path, dtype: str, master: str) -> dict:
    """Build one rank, score the probe, take one SFT step; what the test looks at."""
    join("cpu")
    w = Rank(str(model_path), device="cpu", dtype=dtype, threads=1, lr=LR, master_dtype=master)
    try:
        before = {n: p.full_tensor().detach().clone() for n, p in w.model.named_parameters()}
        probe = w.score([PROBE], 1.0)[0]
        w.train_step([SEQS], "sft", AlgoConfig(), sum(sum(s.mask) for s in SEQS), len(SEQS),
                     1.0, LR, 0.0)
        after = {n: p.full_tensor().detach().clone() for n, p in w.model.named_parameters()}
        states = {v.dtype for s in w.opt.state.values() for k, v in s.items() if k != "step"}
        shard = load_file(w.save_shard(str(tmp_path / f"{dtype}-{master}")))
        return dict(before=before, after=after, probe=probe, states=states,
                    exported=w.full_state_dict(), shard=shard)
    finally:
        w.shutdown()


def changed(run: dict) -> float:
    """Share of the weights of magnitude >= 1/64 (bfloat16 spacing there: >= 1.2e-4) that the
    step changed."""
    big = moved = 0
    for name, w in run["before"].items():
        sel = w.abs() >= 1 / 64
        big += int(sel.sum())
        moved += int((run["after"][name] != w)[sel].sum())
    return moved / big


@pytest.mark.stack
def test_float32_masters_with_bfloat16_compute(tiny_model, tmp_path):
    mixed = one_step(tiny_model, tmp_path, "bfloat16", "float32")
    pure = one_step(tiny_model, tmp_path, "bfloat16", "bfloat16")
    full = one_step(tiny_model, tmp_path, "float32", "float32")
    # the trainer's parameters and optimizer states are float32
    assert {w.dtype for w in mixed["after"].values()} == {torch.float32}
    assert mixed["states"] == {torch.float32} and pure["states"] == {torch.bfloat16}
    # the same step: float32 masters keep it, bfloat16 masters round it away
    assert changed(mixed) > 0.95
    assert changed(pure) < 0.01
    # the forward computes in bfloat16: as a bfloat16 model does, not as a float32 one
    assert max(abs(a - b) for a, b in zip(mixed["probe"], pure["probe"])) < 1e-6
    assert max(abs(a - b) for a, b in zip(mixed["probe"], full["probe"])) > 1e-3
    # the engines get bfloat16 weights: the masters rounded
    for sent in (mixed["exported"], mixed["shard"]):
        assert sent and {t.dtype for t in sent.values()} == {torch.bfloat16}
        for name, t in sent.items():
            assert torch.equal(t, mixed["after"][name].to(torch.bfloat16))


def test_the_gpu_transports_send_the_engines_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    source = engine_source(model, torch.bfloat16)
    assert [(m.name, m.dtype, m.shape) for m in source.metadata()] == [
        (n, torch.bfloat16, tuple(p.shape)) for n, p in model.named_parameters()]
    for (name, sent), (name_p, p) in zip(source, model.named_parameters()):
        assert name == name_p and torch.equal(sent, p.to(torch.bfloat16))

