import math

import torch

from instar.train.losses import grpo_advantages, pg_clip_loss, sft_loss, token_logprobs
from instar.train.worker import Sequence, shard


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 4.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = grpo_advantages(rewards, groups, eps=0.0 + 1e-6)
    # group 0: mean 0.5, std 0.5 -> +1, -1; group 1: equal rewards -> 0; group 2: mean 3, std 1
    expected = torch.tensor([1.0, -1.0, 0.0, 0.0, -1.0, 1.0])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_pg_clip_loss_matches_the_formula():
    logp = torch.tensor([[0.0, -1.0, -0.2, -3.0]])
    old = torch.tensor([[0.0, -1.5, -0.2, -2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0])
    loss, stats = pg_clip_loss(logp, old, adv, mask, 0.2, 0.3, num_tokens=6)
    r = [math.exp(0.5), 1.0, math.exp(-1.0)]
    per_token = [-min(x * 2.0, min(max(x, 0.8), 1.3) * 2.0) for x in r]
    assert math.isclose(loss.item(), sum(per_token) / 6, rel_tol=1e-6)
    assert stats["clip_frac"] == 2  # exp(0.5) > 1.3 and exp(-1) < 0.8
    assert math.isclose(stats["abs_logprob_diff"], 0.5 + 0.0 + 1.0, rel_tol=1e-6)


def test_negative_advantage_clips_from_below():
    logp, old = torch.tensor([[0.0, -3.0]]), torch.tensor([[0.0, -1.0]])
    loss, _ = pg_clip_loss(logp, old, torch.tensor([-1.0]), torch.tensor([[0.0, 1.0]]), 0.2, 0.2, 1)
    # ratio e^-2 < 0.8: min(r*A, clip(r)*A) = min(-0.135, -0.8) = -0.8 -> loss 0.8 (no gradient)
    assert math.isclose(loss.item(), 0.8, rel_tol=1e-6)


def test_token_logprobs_shift_and_temperature():
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    out = token_logprobs(logits, ids, temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, -1)
    assert out[0, 0] == 0 and torch.allclose(out[1, 3], ref[1, 2, ids[1, 3]])


def test_sft_loss_is_a_token_mean():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    loss, _ = sft_loss(logp, torch.tensor([[0.0, 1.0, 1.0]]), num_tokens=2)
    assert loss.item() == 2.5


def test_shard_gives_every_rank_the_same_number_of_micro_batches():
    seqs = [Sequence([i, i], [False, True], [0.0, -1.0]) for i in range(5)]
    parts = shard(seqs, world=2, micro_batch=2)
    assert [len(p) for p in parts] == [2, 2]
    assert [[s.tokens[0] for s in mb] for mb in parts[0]] == [[0, 2], [4]]
    assert [[s.tokens[0] for s in mb] for mb in parts[1]] == [[1, 3], []]
