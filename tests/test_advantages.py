import pytest
import torch

from instar.config import AlgoConfig
from instar.train.advantages import (
    ESTIMATORS,
    AdvantageInputs,
    dynamic_filter,
    gae,
    gae_returns,
    on_policy_distill,
    shaped_rewards_BT,
    whiten,
)

# Groups 7 (two rollouts), 2 (four) and 9 (alone); ids need not be contiguous.
REWARDS = torch.tensor([1.0, 3.0, 0.0, 0.0, 2.0, 2.0, 5.0])
GROUPS = torch.tensor([7, 7, 2, 2, 2, 2, 9])
MASK = torch.tensor([[0.0, 1.0, 1.0]]).expand(7, 3)

# Per rollout, by hand. Batch mean 13/7. Group 7: mean 2, std 1. Group 2: mean 1, std 1.
# rloo: group 7 baselines 3 and 1; group 2: (4 - 0) / 3 for a 0, (4 - 2) / 3 for a 2.
# A rollout alone in its group gets 0 from the group estimators.
EXPECTED = {
    "reinforce": [1, 3, 0, 0, 2, 2, 5],
    "reinforce_baseline": [-6 / 7, 8 / 7, -13 / 7, -13 / 7, 1 / 7, 1 / 7, 22 / 7],
    "rloo": [-2, 2, -4 / 3, -4 / 3, 4 / 3, 4 / 3, 0],
    "grpo": [-1, 1, -1, -1, 1, 1, 0],
    "dr_grpo": [-1, 1, -1, -1, 1, 1, 0],
}


@pytest.mark.parametrize("name", EXPECTED)
def test_return_estimators_hand_computed(name):
    adv_BT = ESTIMATORS[name](AdvantageInputs(REWARDS, GROUPS, MASK))
    expected_BT = torch.tensor(EXPECTED[name])[:, None] * torch.tensor([0.0, 1.0, 1.0])
    assert torch.allclose(adv_BT, expected_BT, atol=1e-5)


def test_the_registry_lists_every_estimator():
    assert set(ESTIMATORS) == {"reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo",
                               "gae", "on_policy_distill", "turn_rloo"}


# Two rollouts of one task: prompt, turn 1 (2 tokens), observation, turn 2 (2 tokens).
TURN_MASK = torch.tensor([[0.0, 1, 1, 0, 1, 1]] * 2)
TURN_REWARDS = torch.tensor([[0.0, 0, 0.5, 0, 0, 1.0],   # 0.5 after turn 1, 1.0 after turn 2
                             [0.0, 0, 0.0, 0, 0, 0.5]])
TURNS = AdvantageInputs(torch.tensor([1.5, 0.5]), torch.tensor([0, 0]), TURN_MASK,
                        token_rewards_BT=TURN_REWARDS)


def test_per_turn_rewards_give_reward_to_go():
    # reward-to-go: row 0 is 1.5 on turn 1, 1.0 on turn 2; row 1 is 0.5 on both.
    assert ESTIMATORS["reinforce"](TURNS).tolist() == [[0, 1.5, 1.5, 0, 1.0, 1.0],
                                                       [0, 0.5, 0.5, 0, 0.5, 0.5]]
    # dr_grpo subtracts the group mean of the rollout rewards, (1.5 + 0.5) / 2 = 1.
    assert ESTIMATORS["dr_grpo"](TURNS).tolist() == [[0, 0.5, 0.5, 0, 0.0, 0.0],
                                                     [0, -0.5, -0.5, 0, -0.5, -0.5]]


def test_gae_hand_computed_over_loss_tokens_only():
    # loss tokens t=1,2,4 with V = 1, 2, 3 (the 9s are off the mask); reward 1 at t=4;
    # gamma = lam = 0.5, so A_t = delta_t + 0.25 A_next:
    # t=4: delta = 1 - 3 = -2;            A = -2
    # t=2: delta = 0 + 0.5 * 3 - 2 = -0.5; A = -0.5 + 0.25 * -2 = -1
    # t=1: delta = 0 + 0.5 * 2 - 1 = 0;    A = 0 + 0.25 * -1 = -0.25
    x = AdvantageInputs(torch.tensor([1.0]), torch.tensor([0]),
                        torch.tensor([[0.0, 1, 1, 0, 1]]),
                        values_BT=torch.tensor([[9.0, 1, 2, 9, 3]]), gamma=0.5, lam=0.5)
    assert gae(x).tolist() == [[0, -0.25, -1.0, 0, -2.0]]
    # R = A + V; e.g. t=2 as a lambda-return: 0.5 * (0.5 * V_4 + 0.5 * R_4) = 0.5 * 2 = 1
    assert gae_returns(x).tolist() == [[0, 0.75, 1.0, 0, 1.0]]


def test_gae_without_values_and_discount_is_reward_to_go():
    x = AdvantageInputs(TURNS.rewards_B, TURNS.group_B, TURN_MASK, token_rewards_BT=TURN_REWARDS,
                        values_BT=torch.zeros(2, 6))
    assert torch.equal(gae(x), ESTIMATORS["reinforce"](TURNS))


def test_on_policy_distill_is_minus_the_reverse_kl_estimate():
    x = AdvantageInputs(torch.zeros(1), torch.zeros(1), torch.tensor([[0.0, 1, 1]]),
                        logprobs_BT=torch.tensor([[-1.0, -2.0, -0.5]]),
                        teacher_logprobs_BT=torch.tensor([[-1.5, -1.0, -0.5]]))
    # teacher - student on the loss tokens: -1 - (-2) = 1, -0.5 - (-0.5) = 0
    assert on_policy_distill(x).tolist() == [[0.0, 1.0, 0.0]]


def test_dynamic_filter_drops_groups_of_equal_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 3.0, 3.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3])
    assert dynamic_filter(rewards, groups).tolist() == [False, False, True, True,
                                                        False, False, False, False]


def test_informative_keeps_groups_with_different_rewards_and_whole_rollouts():
    from instar.sample import Sample
    from instar.train.advantages import informative

    def sample(rollout, group, reward, segment=0):
        return Sample(rollout_id=rollout, group_id=group, segment=segment, tokens=[1, 2],
                      loss_mask=[False, True], logprobs=[None, -0.5], versions=[None, 0],
                      reward=reward, finish_reason="stop")
    samples = [sample("a0", "a", 1.0), sample("a0", "a", 1.0, 1), sample("a1", "a", 0.0),
               sample("b0", "b", 0.5), sample("b1", "b", 0.5)]
    kept = informative(samples)
    assert [(s.rollout_id, s.segment) for s in kept] == [("a0", 0), ("a0", 1), ("a1", 0)]


def test_sample_advantages_count_a_rollout_once_and_use_per_turn_rewards():
    from instar.sample import Sample
    from instar.train.advantages import sample_advantages

    def sample(rollout, reward, segment=0, mask=(False, True, True), info=None):
        n = len(mask)
        return Sample(rollout_id=rollout, group_id="g", segment=segment, tokens=[1] * n,
                      loss_mask=list(mask), logprobs=[-0.5 if m else None for m in mask],
                      versions=[0 if m else None for m in mask], reward=reward,
                      finish_reason="stop", info=info or {})
    # rollout a0 has two segments: one row of the group, not two
    samples = [sample("a0", 1.0), sample("a0", 1.0, 1), sample("a1", 0.0)]
    per_token = {"logprobs": [[lp or 0.0 for lp in s.logprobs] for s in samples]}
    adv, returns = sample_advantages(samples, AlgoConfig(estimator="grpo"), per_token)
    # group rewards [1, 0]: mean 0.5, std 0.5 -> +1 on a0's generated tokens, -1 on a1's
    assert [[round(v, 4) for v in a] for a in adv] == [[0, 1, 1], [0, 1, 1], [0, -1, -1]]
    assert returns is None
    # per-turn rewards 0.25 then 0.5 on two generated spans: reward-to-go 0.75, then 0.5
    env = sample("e0", 0.75, mask=(False, True, False, True),
                 info={"turn_rewards": [0.25, 0.5]})
    adv, _ = sample_advantages([env], AlgoConfig(estimator="reinforce"), {"logprobs": [[0.0, -0.5, 0.0, -0.5]]})
    assert adv == [[0.0, 0.75, 0.0, 0.5]]


def test_whitening_over_the_batch_or_within_each_group():
    adv = torch.tensor([[0.0, 1.0, 3.0], [0.0, 2.0, 0.0], [5.0, 7.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # batch: tokens 1, 3, 2, 5, 7: mean 3.6, population std sqrt(5.04)
    out = whiten(adv, mask, torch.zeros(3))
    std = (sum((v - 3.6) ** 2 for v in (1, 3, 2, 5, 7)) / 5) ** 0.5
    assert out[0, 1].item() == pytest.approx((1 - 3.6) / (std + 1e-6))
    assert out[0, 0] == 0 and out[1, 2] == 0
    # groups {0, 1} (tokens 1, 3, 2: mean 2, std sqrt(2/3)) and {2} (5, 7: mean 6, std 1)
    out = whiten(adv, mask, torch.tensor([4, 4, 1]))
    assert out[0, 2].item() == pytest.approx(1 / ((2 / 3) ** 0.5 + 1e-6))
    assert out[2].tolist() == pytest.approx([-1 / (1 + 1e-6), 1 / (1 + 1e-6), 0.0])


def test_reward_shaping_overlong_penalty_then_scale_then_clip():
    # replies of 6, 9 and 10 tokens (the second row: two replies of 3 and 9) against a
    # limit of 10 with a buffer of 4: 6 is clear; 9 is 3/4 of the way in; 10 pays it all
    mask = torch.tensor([[1.0] * 6 + [0.0] * 7, [1.0] * 3 + [0.0] + [1.0] * 9, [1.0] * 10 + [0.0] * 3])
    x = AdvantageInputs(torch.tensor([1.0, 1.0, 0.5]), torch.zeros(3), mask)
    a = AlgoConfig(overlong_buffer=4, overlong_penalty=0.5, reward_scale=2.0, reward_clip=1.5)
    r = shaped_rewards_BT(x, a, max_tokens=10)
    # (1 - 0) * 2 = 2 -> 1.5; (1 - 0.5 * 3/4) * 2 = 1.25; (0.5 - 0.5) * 2 = 0
    assert r.sum(1).tolist() == pytest.approx([1.5, 1.25, 0.0])
    assert r[0, 5] == 1.5 and r[1, 12] == 1.25 and (r[:, :5] == 0).all()
    assert torch.equal(shaped_rewards_BT(x, AlgoConfig(), 10), x.rewards_B[:, None] * (
        torch.arange(13) == torch.tensor([[5], [12], [9]])))  # off: the plain rewards
