"""MoE routing replay (instar/train/routing.py) on the real tiny Qwen3-MoE model. Choices
are recorded from a forward pass of weights A (on CPU the engine records none) and replayed in
weights B, a perturbed A whose own routing differs for some tokens: with replay every router
uses exactly the recorded experts, without it they differ; replaying a model's own choices
changes nothing; the router still gets gradients. Through the FSDP2 trainer: recorded routing
goes from Sequence to the forward, the flag turns it off, the router trains under replay and
`--train.freeze 'mlp\\.gate\\.'` freezes it."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from instar.config import Config
from instar.train.batch import Sequence
from instar.train.losses import token_logprobs
from instar.train.routing import RoutingReplay
from instar.train.trainer import Trainer

B, T = 4, 16


@pytest.fixture(scope="module")
def moe_model():
    from instar.tasks.tiny_model import builtin_model

    return builtin_model("moe", "tiny", 0)


def load(path, perturb: bool = False):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if perturb:  # weights B: A moved a little, as training would
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * p.std() * torch.randn(p.shape, generator=g))
    return model


def capture(model) -> list[dict]:
    """After each forward, the experts every router handed on, [B, T, layers, top_k] (hooks
    registered after the replay's see its output)."""
    seen, out = {}, []
    routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    for layer, router in enumerate(routers):
        router.register_forward_hook(lambda m, i, o, layer=layer: seen.__setitem__(layer, o[2]))
    model.register_forward_hook(lambda *_: out.append(
        torch.stack([seen[k].view(B, T, -1) for k in range(len(routers))], dim=2)))
    return out


def ids():
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(0))


def logprobs(model, x, replay=None, experts=None):
    if replay:
        replay.use(experts)
    return token_logprobs(model(input_ids=x).logits, x, 1.0)


def test_replay_forces_the_recorded_experts_and_trains_the_router(moe_model):
    x, a, b = ids(), load(moe_model), load(moe_model, perturb=True)
    recorded = capture(a)
    logprobs(a, x)
    recorded_BTLK = recorded[-1]
    replay, chosen = RoutingReplay(b), capture(b)
    assert replay.routers == 2
    logprobs(b, x, replay, None)
    own_BTLK = chosen[-1]
    differ = (own_BTLK.sort(-1).values != recorded_BTLK.sort(-1).values).any(-1)
    assert 0 < differ.float().mean() < 1  # replay off: B routes some tokens elsewhere
    replayed = logprobs(b, x, replay, recorded_BTLK)
    assert torch.equal(chosen[-1], recorded_BTLK)  # replay on: every token, every layer
    # replaying B's own choices is B's own forward: the weights are the router's softmax
    assert torch.allclose(logprobs(b, x, replay, own_BTLK), logprobs(b, x, replay, None),
                          atol=1e-6)
    # the router gets gradients through the weights of the replayed experts
    replayed[:, 1:].mean().backward()
    grads = [m.weight.grad for m in b.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    grads = [g.clone() for g in grads]
    # recomputed layers (activation checkpointing) replay the same choices: same gradients
    b.zero_grad()
    b.gradient_checkpointing_enable({"use_reentrant": False})
    b.train()
    logprobs(b, x, replay, recorded_BTLK)[:, 1:].mean().backward()
    again = [m.weight.grad for m in b.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    assert all(torch.allclose(g, h, atol=1e-7) for g, h in zip(grads, again))


@pytest.mark.stack
def test_the_trainer_replays_recorded_routing_and_can_freeze_the_router(ray_session, moe_model,
                                                                        tmp_path):
    x, a, b = ids(), load(moe_model), load(moe_model, perturb=True)
    recorded = capture(b)
    logprobs(b, x)
    routing_BTLK = recorded[-1]  # recorded under B, replayed in A
    free = logprobs(a, x)
    replayed = logprobs(a, x, RoutingReplay(a), routing_BTLK)
    assert (free - replayed).abs().max() > 1e-3
    lengths = [T, T - 3, T - 1, T - 5]  # padded micro-batches
    seqs = [Sequence(x[i, :n].tolist(), [False] + [True] * (n - 1), [0.0] * n,
                     routed_experts=routing_BTLK[i, :n].tolist()) for i, n in enumerate(lengths)]
    start = load_file(f"{moe_model}/model.safetensors")
    gate = "model.layers.0.mlp.gate.weight"
    for replay, freeze, ranks, expected in [(True, [], 2, replayed), (False, [r"mlp\.gate\."],
                                                                      1, free)]:
        cfg = Config().validate()
        cfg.train.routing_replay, cfg.train.freeze, cfg.train.num_ranks = replay, freeze, ranks
        trainer = Trainer(cfg, str(moe_model))
        try:
            scores = trainer.score(seqs, 1.0)
            for i, n in enumerate(lengths):
                assert torch.allclose(torch.tensor(scores[i]), expected[i, :n], atol=1e-5)
            trainer.step(seqs, "sft", 1e-2)
            trainer.save_weights(str(tmp_path / "w.safetensors"))
        finally:
            trainer.shutdown()
        after = load_file(tmp_path / "w.safetensors")
        assert not torch.equal(after["model.layers.0.self_attn.q_proj.weight"],
                               start["model.layers.0.self_attn.q_proj.weight"])
        assert torch.equal(after[gate], start[gate]) == bool(freeze)
