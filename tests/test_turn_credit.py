"""turn_rloo, the per-turn credit estimator: hand-computed advantages, and the length-bias check
by exact enumeration (its expected update leaves the number of turns alone unless the reward
asks for it; the per-turn-index normalisation of verl's RFC #7244 does not). Fast: tensors only.
"""

import itertools

import pytest
import torch

from instar.train.advantages import ESTIMATORS, AdvantageInputs

# Token layout of a row: prompt, turn 1 (2 tokens), observation, turn 2 (2 tokens).
ONE_TURN = [0.0, 1, 1, 0, 0, 0]
TWO_TURNS = [0.0, 1, 1, 0, 1, 1]


def episodes(turn_rewards: list[list[float]], group: list[int]) -> AdvantageInputs:
    """Rows of one or two turns in the layout above, each turn's reward on its last token."""
    mask, rewards = [], []
    for r in turn_rewards:
        mask.append(ONE_TURN if len(r) == 1 else TWO_TURNS)
        rewards.append([0.0, 0, r[0], 0, 0, r[1] if len(r) == 2 else 0])
    return AdvantageInputs(torch.tensor([sum(r) for r in turn_rewards]), torch.tensor(group),
                           torch.tensor(mask), token_rewards_BT=torch.tensor(rewards))


def test_hand_computed_two_groups():
    # Group 5: a (1 turn), b and c (2 turns). Group 2: d (2 turns, turn 1 one token long),
    # e (1 turn, from the row's first token). Rewards on each turn's last token.
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 0],
                         [0.0, 1, 1, 0, 1, 1],
                         [0.0, 1, 1, 0, 1, 1],
                         [0.0, 1, 0, 1, 1, 1],
                         [1.0, 1, 0, 0, 0, 0]])
    token_rewards = torch.tensor([[0.0, 0, 1.0, 0, 0, 0],    # a: r = 1
                                  [0.0, 0, 0.5, 0, 0, 1.0],  # b: r = 0.5, 1
                                  [0.0, 0, 0.0, 0, 0, 0.5],  # c: r = 0, 0.5
                                  [0.0, 0, 0, 0, 0, 2.0],    # d: r = 0, 2
                                  [0.0, 1.0, 0, 0, 0, 0]])   # e: r = 1
    x = AdvantageInputs(torch.tensor([1.0, 1.5, 0.5, 2.0, 1.0]), torch.tensor([5, 5, 5, 2, 2]),
                        mask, token_rewards_BT=token_rewards)
    # G (turn 1, turn 2): a (1), b (1.5, 1), c (0.5, 0.5), d (2, 2), e (1).
    # Turn 1, mean of the others' G: a (1.5 + 0.5) / 2 = 1; b (1 + 0.5) / 2; c (1 + 1.5) / 2;
    # d 1; e 2. Turn 2, among those that reached it: b 0.5; c 1; d none, so 0.
    expected = torch.tensor([[0.0, 0, 0, 0, 0, 0],
                             [0.0, 0.75, 0.75, 0, 0.5, 0.5],
                             [0.0, -0.75, -0.75, 0, -0.5, -0.5],
                             [0.0, 1, 0, 2, 2, 2],
                             [-1.0, -1, 0, 0, 0, 0]])
    assert torch.allclose(ESTIMATORS["turn_rloo"](x), expected)


def test_no_reward_spread_gives_zero():
    # Same return at every turn an episode reaches: 1 at turn 1 for all, 0.5 at turn 2.
    x = episodes([[1.0], [0.5, 0.5], [1.0], [0.5, 0.5]], [0, 0, 0, 0])
    assert torch.equal(ESTIMATORS["turn_rloo"](x), torch.zeros(4, 6))
    # Without per-turn rewards: the episode reward on every loss token.
    x = AdvantageInputs(torch.tensor([2.0, 2.0, 2.0]), torch.tensor([0, 0, 0]),
                        torch.tensor([ONE_TURN, TWO_TURNS, TWO_TURNS]))
    assert torch.equal(ESTIMATORS["turn_rloo"](x), torch.zeros(3, 6))


def naive_turn_1(turn_rewards: list[list[float]]) -> list[float]:
    """A_i1 of the per-turn-index normalisation (MT-GRPO style, RFC #7244's warning):
    sum over j = 1..K_i of r_ij - mean of r_.j over the episodes that reached turn j."""
    K = max(len(r) for r in turn_rewards)
    means = [sum(r[j] for r in turn_rewards if len(r) > j) /
             sum(len(r) > j for r in turn_rewards) for j in range(K)]
    return [sum(r[j] - means[j] for j in range(len(r))) for r in turn_rewards]


def turn_rloo_turn_1(turn_rewards: list[list[float]]) -> list[float]:
    """A_i1 of the real estimator, one group (the first token of turn 1)."""
    return ESTIMATORS["turn_rloo"](episodes(turn_rewards, [0] * len(turn_rewards)))[:, 1].tolist()


def expected_gradient(p: float, short: list[list[float]], long: list[list[float]], turn_1,
                      n: int = 4) -> float:
    """E[sum_i d/dlogit log pi(a_i1) * A_i1] for a group of n episodes, exactly: at turn 1 each
    episode continues with probability p = sigmoid(logit) (d log pi = 1 - p) or stops (-p).
    `short`/`long` list the equally likely per-turn rewards of a stopped/continued episode."""
    total = 0.0
    for choices in itertools.product([False, True], repeat=n):
        prob = 1.0
        for c in choices:
            prob *= p if c else 1 - p
        outcomes = [long if c else short for c in choices]
        for rewards in itertools.product(*outcomes):
            adv = turn_1([list(r) for r in rewards])
            score = sum((1 - p if c else -p) * a for c, a in zip(choices, adv))
            total += prob / len(list(itertools.product(*outcomes))) * score
    return total


PS = [0.1, 0.3, 0.5, 0.8]
# Length-indifferent tasks, the total reward the same whichever the choice: a fixed one, and one
# with a random success s in {0, 1} (probability 1/2, independent of the choice; total s either
# way, half of it after turn 2 for long episodes), where the advantages are not all zero.
FLAT = {"fixed": ([[1.0]], [[0.5, 0.5]]),
        "noisy": ([[0.0], [1.0]], [[0.0, 0.0], [0.5, 0.5]])}


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("task", FLAT)
def test_no_length_bias_when_the_reward_ignores_the_number_of_turns(task, p):
    short, long = FLAT[task]
    assert abs(expected_gradient(p, short, long, turn_rloo_turn_1)) < 1e-9
    # The per-turn-index normalisation pushes toward short episodes: a second turn subtracts
    # that turn's mean reward (positive here), a hidden penalty on continuing.
    assert expected_gradient(p, short, long, naive_turn_1) < -1e-3


@pytest.mark.parametrize("p", PS)
def test_a_reward_for_length_gives_exactly_the_true_gradient(p):
    # Long episodes total 1.5, short ones 1: J = 1 + 0.5 p, dJ/dlogit = 0.5 p (1 - p), and the
    # leave-one-out update's expectation is n times that.
    grad = expected_gradient(p, [[1.0]], [[0.5, 1.0]], turn_rloo_turn_1)
    assert grad > 0
    assert grad == pytest.approx(4 * 0.5 * p * (1 - p), abs=1e-9)
