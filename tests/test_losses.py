import math

import pytest
import torch

from instar.config import AlgoConfig
from instar.train.batch import Sequence, pack, shard
from instar.train.losses import (
    adaptive_kl,
    cispo_loss,
    combine,
    gspo_loss,
    importance_weights,
    kl_BT,
    mismatch_metrics,
    policy_loss,
    ppo_clip_loss,
    seq_mean,
    sft_loss,
    token_logprobs,
    token_mean,
    value_loss,
)


def pg(logp, old, adv_B, mask, **algo):
    b = {"mask": mask, "behaviour_logprobs": old, "advantages": adv_B[:, None] * mask}
    return policy_loss(logp, torch.zeros_like(logp), b, AlgoConfig(**algo), num_tokens=6,
                       num_seqs=1)


def test_policy_loss_ppo_matches_the_formula():
    logp = torch.tensor([[0.0, -1.0, -0.2, -3.0]])
    old = torch.tensor([[0.0, -1.5, -0.2, -2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    loss, stats = pg(logp, old, torch.tensor([2.0]), mask, clip_low=0.2, clip_high=0.3)
    r = [math.exp(0.5), 1.0, math.exp(-1.0)]
    per_token = [-min(x * 2.0, min(max(x, 0.8), 1.3) * 2.0) for x in r]
    assert math.isclose(loss.item(), sum(per_token) / 6, rel_tol=1e-6)
    assert math.isclose(stats["clip_frac"], 2 / 6)  # exp(0.5) > 1.3 and exp(-1) < 0.8
    assert math.isclose(stats["abs_logprob_diff"], 0.5 + 0.0 + 1.0, rel_tol=1e-6)  # a sum
    assert stats["mismatch_tokens"] == 3
    # sequence aggregation: the mean over the sequence's 3 tokens, over 1 sequence
    loss, _ = pg(logp, old, torch.tensor([2.0]), mask, clip_low=0.2, clip_high=0.3,
                 aggregation="sequence")
    assert math.isclose(loss.item(), sum(per_token) / 3, rel_tol=1e-6)


def test_policy_loss_negative_advantage_clips_from_below():
    logp, old = torch.tensor([[0.0, -3.0]]), torch.tensor([[0.0, -1.0]])
    loss, _ = pg(logp, old, torch.tensor([-1.0]), torch.tensor([[0.0, 1.0]]))
    # ratio e^-2 < 0.8: min(r*A, clip(r)*A) = min(-0.135, -0.8) = -0.8 -> loss 0.8/6
    assert math.isclose(loss.item(), 0.8 / 6, rel_tol=1e-6)


def test_policy_loss_off_policy_correction_and_kl_term():
    mask = torch.tensor([[1.0, 1.0]])
    logp = torch.tensor([[-1.0, -1.0]])
    b = {"mask": mask, "behaviour_logprobs": torch.tensor([[-1.0, -3.0]]),  # weights e^0=1, e^2=7.39
         "ref_logprobs": torch.tensor([[-1.5, -1.0]]), "advantages": torch.tensor([[1.0, 1.0]])}
    algo = AlgoConfig(is_mode="truncate", is_high=2.0, kl_coef=0.1, kl_estimator="k1")
    loss, stats = policy_loss(logp, torch.zeros_like(logp), b, algo, num_tokens=2, num_seqs=1)
    # trainer-old is this forward's logp (one update per batch): ratios 1, PPO losses -A = -1;
    # IS weights trainer-old / behaviour: exp(0) = 1 and exp(2) truncated to 2;
    # k1 = logp - ref = 0.5, 0 -> (-1 * 1 + 0.1 * 0.5 - 1 * 2 + 0) / 2
    assert math.isclose(loss.item(), (-1.0 + 0.05 - 2.0) / 2, rel_tol=1e-6)
    assert stats["is_filtered"] == 0.5 and math.isclose(stats["kl"], 0.25)


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
    parts = shard(seqs, world=2, budget=4)  # 4 padded tokens: two sequences of 2
    assert [len(p) for p in parts] == [2, 2]
    assert [[s.tokens[0] for s in mb] for mb in parts[0]] == [[0, 2], [4]]
    assert [[s.tokens[0] for s in mb] for mb in parts[1]] == [[1, 3], []]
    # a budget counts padding: lengths 1, 1, 3 pack as [1, 1] and [3]; a longer one goes alone
    seqs = [Sequence([0] * n, [True] * n, [0.0] * n) for n in (1, 1, 3, 9)]
    assert [[len(s.tokens) for s in mb] for mb in shard(seqs, 1, 4)[0]] == [[1, 1], [3], [9]]


def test_pack_takes_the_fewest_micro_batches_then_the_least_padding():
    def lengths(ns, budget):
        seqs = [Sequence([0] * n, [True] * n, [0.0] * n) for n in ns]
        return [[len(s.tokens) for s in mb] for mb in pack(seqs, budget)]
    # filling up to the budget in order would give [10, 10, 10, 100] and [100]: 500 padded
    # tokens; the split below pads 230 in the same number of micro-batches
    assert lengths([10, 10, 10, 100, 100], 400) == [[10, 10, 10], [100, 100]]
    # what fits in one micro-batch stays in one, however much it pads
    assert lengths([1, 1, 300], 10_000) == [[1, 1, 300]]
    assert lengths([1, 9, 1], 9) == [[1], [9], [1]]  # in order: the two 1s are not put together
    assert lengths([], 4) == [[]]


def test_aggregations():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert token_mean(loss, mask, num_tokens=3).item() == (1 + 2 + 6) / 3
    # per sequence: (1 + 2) / 2, 6 / 1, and 0 for the sequence without loss tokens
    assert seq_mean(loss, mask, num_seqs=3).item() == (1.5 + 6.0 + 0.0) / 3


def test_ppo_dual_clip_bounds_the_loss_of_negative_advantages():
    # ratios 5, 5, 1 (old = 0); clip 0.2 band [0.8, 1.2]; dual clip c = 3
    logp = torch.tensor([[math.log(5), math.log(5), 0.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, clipped = ppo_clip_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), 0.2, 0.2,
                                  dual_clip=3.0)
    # A=-1, r=5: PPO gives -min(-5, -1.2) = 5, dual clip min(5, 3) = 3 (constant, no gradient)
    # A=+1, r=5: -min(5, 1.2) = -1.2 (dual clip does not apply)
    # A=-1, r=1: -min(-1, -1) = 1 < 3
    assert torch.allclose(loss, torch.tensor([[3.0, -1.2, 1.0]]))
    assert clipped.tolist() == [[True, True, False]]
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, 1.0]]))  # d(-rA)/dlogp = -rA
    plain, _ = ppo_clip_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), 0.2, 0.2)
    assert math.isclose(plain[0, 0].item(), 5.0, rel_tol=1e-6)


def test_gspo_matches_the_sequence_level_formula_in_value_and_gradient():
    mask = torch.tensor([[0.0, 1, 1], [0, 1, 0]])
    old = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -1.0]])
    delta = torch.tensor([[0.0, 0.2, 0.4], [0.0, -0.6, 99.0]])  # 99 is off the mask
    adv_B = torch.tensor([1.0, -1.0])
    logp = (old + delta).requires_grad_()
    loss_BT, clipped = gspo_loss(logp, old, adv_B[:, None].expand(2, 3), mask, 0.5, 0.5)
    loss = seq_mean(loss_BT, mask, num_seqs=2)
    loss.backward()
    ours = logp.grad.clone()
    # direct: s_i = exp(mean log-ratio over loss tokens) = exp(0.3), exp(-0.6), both in [0.5, 1.5]
    logp.grad = None
    s0 = torch.exp((logp[0, 1] - old[0, 1] + logp[0, 2] - old[0, 2]) / 2)
    s1 = torch.exp(logp[1, 1] - old[1, 1])
    direct = (-s0 * 1.0 + s1 * 1.0) / 2
    direct.backward()
    assert math.isclose(loss.item(), (-math.exp(0.3) + math.exp(-0.6)) / 2, rel_tol=1e-6)
    assert math.isclose(loss.item(), direct.item(), rel_tol=1e-6)
    assert torch.allclose(ours, logp.grad)
    assert not clipped.any()


def test_gspo_clips_the_whole_sequence():
    mask, old = torch.ones(1, 2), torch.zeros(1, 2)
    logp = torch.tensor([[0.2, 0.4]], requires_grad=True)  # s = exp(0.3) = 1.35 > 1.2
    loss_BT, clipped = gspo_loss(logp, old, torch.ones(1, 2), mask, 0.2, 0.2)
    seq_mean(loss_BT, mask, 1).backward()
    assert torch.allclose(loss_BT, torch.tensor([[-1.2, -1.2]]))
    assert clipped.all() and torch.equal(logp.grad, torch.zeros(1, 2))


def test_cispo_gradient_flows_only_through_logp():
    # ratios 2, 0.5, 1.1; band [0.8, 1.2] gives weights 1.2, 0.8, 1.1
    logp = torch.tensor([[math.log(2), math.log(0.5), math.log(1.1)]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 1.0]])
    loss_BT, clipped = cispo_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), 0.2, 0.2)
    # loss_t = -w A logp: -1.2 * ln 2, -0.8 * -2 * ln 0.5, -1.1 * ln 1.1
    assert torch.allclose(loss_BT, torch.tensor([[-0.831777, -1.109035, -0.104841]]), atol=1e-5)
    loss_BT.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.2, 1.6, -1.1]]))  # -w A, nothing from w
    assert clipped.tolist() == [[True, True, False]]


def test_gspo_token_form_keeps_per_token_advantages():
    mask = torch.ones(1, 2)
    logp = torch.tensor([[0.1, -0.1]], requires_grad=True)  # s = exp(0) = 1
    loss_BT, _ = gspo_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, 3.0]]), mask, 0.2, 0.2)
    seq_mean(loss_BT, mask, 1).backward()
    # grad_t = -s A_t / 2 (a sequence ratio with gradient would give -s (1 + 3) / 4 to both)
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -1.5]]))


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # d = ln(0.25 / 0.5) = -ln 2 = -0.693147
    assert math.isclose(kl_BT(logp, ref, "k1").item(), 0.693147, rel_tol=1e-5)
    assert math.isclose(kl_BT(logp, ref, "k2").item(), 0.240227, rel_tol=1e-5)  # (ln 2)^2 / 2
    assert math.isclose(kl_BT(logp, ref, "k3").item(), 0.193147, rel_tol=1e-5)  # .5 + ln2 - 1


# Log-ratios old - behaviour; loss tokens t=1,2 (the 5 is off the mask).
# token weights: [2, 2], [4, 1/16]; sequence: 4, 1/4; geometric: 2, 1/2. Band [0.4, 3].
IS_MASK = torch.tensor([[0.0, 1, 1], [0, 1, 1]])
IS_LOG_RATIO = torch.tensor([[5.0, math.log(2), math.log(2)], [0, math.log(4), -math.log(16)]])
IS_CASES = [  # level, mode, weights on the loss tokens, changed tokens out of 4
    ("token", "mask", [[2, 2], [0, 0]], 2),
    ("token", "clip", [[2, 2], [3, 0.4]], 2),
    ("token", "truncate", [[2, 2], [3, 1 / 16]], 1),
    ("sequence", "mask", [[0, 0], [0, 0]], 4),
    ("sequence", "clip", [[3, 3], [0.4, 0.4]], 4),
    ("sequence", "truncate", [[3, 3], [0.25, 0.25]], 2),
    ("geometric", "mask", [[2, 2], [0.5, 0.5]], 0),
    ("geometric", "clip", [[2, 2], [0.5, 0.5]], 0),
]


@pytest.mark.parametrize("level,mode,expected,changed", IS_CASES)
def test_importance_weights_levels_and_modes(level, mode, expected, changed):
    behaviour = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, -0.5]])
    w_BT, filtered = importance_weights(behaviour + IS_LOG_RATIO, behaviour, IS_MASK, level,
                                        mode, 0.4, 3.0, num_tokens=4)
    assert torch.allclose(w_BT[:, 1:], torch.tensor(expected, dtype=torch.float), atol=1e-5)
    assert filtered == changed / 4


def test_mismatch_metrics():
    logp, behaviour = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[9.0, -1.5, -1.0]])
    out = mismatch_metrics(logp, behaviour, torch.tensor([[0.0, 1, 1]]))
    # |diff| = 0.5, 1; k3 with d = logp - behaviour = 0.5, -1:
    # e^0.5 - 1.5 = 0.148721, e^-1 + 1 - 1 = 0.367879
    assert math.isclose(out["abs_logprob_diff"], 1.5, rel_tol=1e-6)
    assert math.isclose(out["k3"], 0.148721 + 0.367879, rel_tol=1e-5)
    assert out["mismatch_tokens"] == 2


def test_value_loss_is_clipped_around_the_old_values():
    values = torch.tensor([[1.0, 3.0, 0.0]], requires_grad=True)
    old, returns = torch.zeros(1, 3), torch.tensor([[2.0, 0.0, -2.0]])
    loss = value_loss(values, old, returns, clip=0.5)
    # t0: max((1-2)^2, (0.5-2)^2) / 2 = 1.125 (clipped branch: no gradient)
    # t1: max((3-0)^2, (0.5-0)^2) / 2 = 4.5; t2: V inside the band: (0+2)^2 / 2 = 2
    assert loss.tolist() == [[1.125, 4.5, 2.0]]
    loss.sum().backward()
    assert values.grad.tolist() == [[0.0, 3.0, 2.0]]


def test_entropy_is_over_the_whole_vocabulary_and_its_bonus_lowers_the_loss():
    logits, ids = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    logp, ent = token_logprobs(logits, ids, temperature=0.7, entropy=True)
    p = torch.softmax(logits / 0.7, -1)
    assert torch.allclose(ent[:, 1:], -(p * p.log()).sum(-1)[:, :-1], atol=1e-6)
    assert ent[0, 0] == 0 and torch.equal(logp, token_logprobs(logits, ids, 0.7))
    mask, adv = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0, 1.0]]), torch.ones(2, 5)
    b = {"mask": mask, "behaviour_logprobs": logp.detach(), "advantages": adv}
    plain, stats = policy_loss(logp, ent, b, AlgoConfig(), num_tokens=6, num_seqs=2)
    bonus, _ = policy_loss(logp, ent, b, AlgoConfig(entropy_coef=0.1), num_tokens=6, num_seqs=2)
    mean_ent = (ent * mask).sum().item() / 6
    assert math.isclose(stats["entropy"], mean_ent, rel_tol=1e-6)
    assert math.isclose(bonus.item(), plain.item() - 0.1 * mean_ent, rel_tol=1e-6)


def test_several_updates_clip_against_the_old_policy_and_weight_old_over_behaviour():
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    b = {"mask": mask, "behaviour_logprobs": torch.tensor([[-1.0, -1.5, -0.5]]),
         "old_logprobs": torch.tensor([[-1.0, -1.5, -1.6]]), "advantages": torch.ones(1, 3)}
    a = AlgoConfig(is_mode="clip", is_low=0.7, is_high=1.5, clip_low=0.2, clip_high=0.2)
    loss, stats = policy_loss(logp, torch.zeros(1, 3), b, a, num_tokens=3, num_seqs=1)
    r = [1.0, math.exp(0.5), math.exp(0.6)]  # now / old: the last two clipped at 1.2
    w = [1.0, 1.0, min(max(math.exp(-1.1), 0.7), 1.5)]  # old / behaviour, clipped into the band
    assert math.isclose(loss.item(), -(1.0 * w[0] + 1.2 * w[1] + 1.2 * w[2]) / 3, rel_tol=1e-6)
    assert math.isclose(stats["clip_frac"], 2 / 3)
    assert math.isclose(stats["approx_kl"], sum(x - 1 - math.log(x) for x in r) / 3, rel_tol=1e-6)
    assert (stats["ratio_max"], stats["ratio_min"]) == pytest.approx((math.exp(0.6), 1.0))
    assert math.isclose(stats["is_filtered"], 1 / 3)
    # the first of several updates (old = the weights now) is the single update of a step:
    # the same loss and gradient as when the old policy is this forward's own
    first = {**b, "old_logprobs": logp.detach().clone()}
    single = {k: v for k, v in b.items() if k != "old_logprobs"}
    grads = []
    for batch in (first, single):
        logp.grad = None
        loss, stats = policy_loss(logp, torch.zeros(1, 3), batch, a, num_tokens=3, num_seqs=1)
        loss.backward()
        grads.append((loss.item(), logp.grad.clone(), stats))
    assert grads[0][0] == grads[1][0] and torch.equal(grads[0][1], grads[1][1])
    assert grads[0][2] == grads[1][2] and grads[0][2]["approx_kl"] == 0.0
    # correction off: the ratio is still against the old policy, unweighted; only a single
    # update (no old log-probs scored) takes the engine's log-probs as its denominator
    off = AlgoConfig(clip_low=0.2, clip_high=0.2)
    loss, stats = policy_loss(logp, torch.zeros(1, 3), b, off, num_tokens=3, num_seqs=1)
    assert math.isclose(loss.item(), -(1.0 + 1.2 + 1.2) / 3, rel_tol=1e-6)
    assert "is_filtered" not in stats
    loss, stats = policy_loss(logp, torch.zeros(1, 3), single, off, num_tokens=3, num_seqs=1)
    r = [1.0, math.exp(0.5), math.exp(-0.5)]  # now / behaviour: clipped at 1.2 and 0.8
    assert math.isclose(loss.item(), -(1.0 + 1.2 + r[2]) / 3, rel_tol=1e-6)


def test_stats_combine_by_summing_shares_and_keeping_extremes():
    totals = combine({}, {"loss": 0.5, "ratio_max": 1.1, "ratio_min": 0.9, "mismatch_tokens": 3})
    combine(totals, {"loss": 0.25, "ratio_max": 1.3, "ratio_min": 0.95, "mismatch_tokens": 2})
    assert totals == {"loss": 0.75, "ratio_max": 1.3, "ratio_min": 0.9, "mismatch_tokens": 5}


def test_adaptive_kl_moves_toward_the_target_by_at_most_a_fifth_per_horizon():
    assert math.isclose(adaptive_kl(0.1, 0.02, 0.01, 100, 50), 0.1 * (1 + 0.2 * 0.5))  # capped
    assert math.isclose(adaptive_kl(0.1, 0.009, 0.01, 100, 100), 0.1 * (1 - 0.1))
    assert adaptive_kl(0.1, 0.01, 0.01, 100, 100) == 0.1
