"""Advantage estimators: one function per estimator, selected by name from `ESTIMATORS`.

Every estimator has the signature `fn(x: AdvantageInputs) -> adv_BT` and returns per-token
advantages, zero outside `x.mask_BT`. One row per rollout: a rollout of several segments
counts once in its group's baseline. Add an estimator by decorating a function with
`@estimator("name")`.

Return-based estimators (reinforce, reinforce_baseline, rloo, grpo, dr_grpo) use the return
G_t of `returns_BT`: the rollout's reward on every loss token, or, when per-turn rewards are
given, the reward-to-go from token t. Their baselines come from the rollout rewards `rewards_B`.
turn_rloo takes G at each turn's start, less the mean over the group's others at that turn.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

EPS = 1e-6
"""Added to the group std in `grpo`, so a group of equal rewards gets advantage 0."""


@dataclass(frozen=True, slots=True)
class AdvantageInputs:
    """What the estimators read; B rollouts, T token positions. Example: 4 rollouts of 2 tasks,
    `rewards_B=[1., 0., 0., 0.]`, `group_B=[0, 0, 1, 1]`, `mask_BT` of shape (4, T)."""

    rewards_B: torch.Tensor
    """Scalar reward of each rollout (the sum of its per-turn rewards where those are given)."""
    group_B: torch.Tensor
    """Integer group id of each rollout (rollouts of the same task share one)."""
    mask_BT: torch.Tensor
    """1 on loss (generated) tokens, 0 elsewhere (prompt, observations, padding)."""
    token_rewards_BT: torch.Tensor | None = None
    """Per-turn rewards, each on the last token of its turn, 0 elsewhere."""
    values_BT: torch.Tensor | None = None
    """Critic values V(s_t) at each token (`gae` only)."""
    logprobs_BT: torch.Tensor | None = None
    """Student (policy) log-probs of the sampled tokens (`on_policy_distill` only)."""
    teacher_logprobs_BT: torch.Tensor | None = None
    """Teacher log-probs of the same tokens (`on_policy_distill` only)."""
    gamma: float = 1.0
    """Discount per loss token (`gae` only)."""
    lam: float = 1.0
    """GAE's lambda (`gae` only)."""


Estimator = Callable[[AdvantageInputs], torch.Tensor]
ESTIMATORS: dict[str, Estimator] = {}
"""Advantage estimators by name (--algo.estimator)."""


def estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Register the decorated function in `ESTIMATORS` under `name`."""
    def register(fn: Estimator) -> Estimator:
        ESTIMATORS[name] = fn
        return fn
    return register


def last_BT(mask_BT: torch.Tensor) -> torch.Tensor:
    """True on each row's last loss token."""
    mask_BT = mask_BT.bool()
    return mask_BT & (mask_BT.flip(1).cumsum(1).flip(1) == 1)


def rewards_BT(x: AdvantageInputs) -> torch.Tensor:
    """The per-turn rewards if given, else the rollout's reward on its last loss token."""
    if x.token_rewards_BT is not None:
        return x.token_rewards_BT
    return x.rewards_B[:, None] * last_BT(x.mask_BT)


def shaped_rewards_BT(x: AdvantageInputs, a, max_tokens: int) -> torch.Tensor:
    """`rewards_BT` after the reward knobs of `a` (an AlgoConfig), in this order:

      1. DAPO's soft overlong penalty, on the row's last loss token: with L the row's longest
         reply (run of loss tokens) and b = `overlong_buffer`, minus `overlong_penalty` times
         clamp((L - (max_tokens - b)) / b, 0, 1);
      2. times `reward_scale`;
      3. each (per-turn) reward clipped into [-reward_clip, reward_clip], if `reward_clip`.
    """
    m_BT, r_BT = x.mask_BT, rewards_BT(x)
    if a.overlong_buffer:
        c_BT = m_BT.cumsum(1)
        reply_BT = c_BT - torch.cummax(c_BT * (1 - m_BT), 1).values  # the reply's tokens so far
        over_B = ((reply_BT.amax(1) - max_tokens + a.overlong_buffer) / a.overlong_buffer).clamp(0, 1)
        r_BT = r_BT - a.overlong_penalty * over_B[:, None] * last_BT(m_BT)
    r_BT = r_BT * a.reward_scale
    return r_BT.clamp(-a.reward_clip, a.reward_clip) if a.reward_clip else r_BT


def whiten(adv_BT: torch.Tensor, mask_BT: torch.Tensor, key_B: torch.Tensor) -> torch.Tensor:
    """(A - mean) / (std + EPS) over the loss tokens of the rows that share a key (the group,
    or one key for the whole batch)."""
    same_BB = (key_B[:, None] == key_B[None, :]).to(adv_BT.dtype)
    n_B = same_BB @ mask_BT.sum(1)
    mean_B = same_BB @ (adv_BT * mask_BT).sum(1) / n_B
    var_B = same_BB @ ((adv_BT - mean_B[:, None]) ** 2 * mask_BT).sum(1) / n_B
    return (adv_BT - mean_B[:, None]) / (var_B.sqrt()[:, None] + EPS) * mask_BT


def returns_BT(x: AdvantageInputs) -> torch.Tensor:
    """G_t = sum of `rewards_BT` at or after token t (undiscounted reward-to-go): without
    per-turn rewards, the rollout's reward on every loss token. Zero outside the mask."""
    return rewards_BT(x).flip(1).cumsum(1).flip(1) * x.mask_BT


def group_stats(values_B: torch.Tensor,
                group_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per rollout: size n, mean and population std of the values in its group."""
    same_BB = (group_B[:, None] == group_B[None, :]).to(values_B.dtype)
    n_B = same_BB.sum(1)
    mean_B = same_BB @ values_B / n_B
    std_B = (same_BB @ (values_B - mean_B) ** 2 / n_B).sqrt()
    return n_B, mean_B, std_B


@estimator("reinforce")
def reinforce(x: AdvantageInputs) -> torch.Tensor:
    """A_t = G_t."""
    return returns_BT(x)


@estimator("reinforce_baseline")
def reinforce_baseline(x: AdvantageInputs) -> torch.Tensor:
    """A_t = G_t - mean of the rewards over the whole batch."""
    return (returns_BT(x) - x.rewards_B.mean()) * x.mask_BT


@estimator("rloo")
def rloo(x: AdvantageInputs) -> torch.Tensor:
    """A_t = G_t - (sum of the group's rewards - r_i) / (n - 1): the mean of the others.

    A rollout alone in its group has no others; its baseline is its own reward.
    """
    n_B, mean_B, _ = group_stats(x.rewards_B, x.group_B)
    others_B = (n_B * mean_B - x.rewards_B) / (n_B - 1)
    baseline_B = torch.where(n_B > 1, others_B, x.rewards_B)
    return (returns_BT(x) - baseline_B[:, None]) * x.mask_BT


@estimator("grpo")
def grpo(x: AdvantageInputs) -> torch.Tensor:
    """A_t = (G_t - group mean) / (group std + EPS), std without Bessel's correction."""
    _, mean_B, std_B = group_stats(x.rewards_B, x.group_B)
    return (returns_BT(x) - mean_B[:, None]) / (std_B[:, None] + EPS) * x.mask_BT


@estimator("dr_grpo")
def dr_grpo(x: AdvantageInputs) -> torch.Tensor:
    """A_t = G_t - group mean (Dr. GRPO: no division by the std)."""
    _, mean_B, _ = group_stats(x.rewards_B, x.group_B)
    return (returns_BT(x) - mean_B[:, None]) * x.mask_BT


@estimator("gae")
def gae(x: AdvantageInputs) -> torch.Tensor:
    """GAE over the loss tokens only (prompt and observation tokens are skipped):

        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next

    where next is the next loss token of the row (V_next = A_next = 0 after the last) and r_t
    is `rewards_BT`.
    """
    mask_BT, r_BT = x.mask_BT.bool(), rewards_BT(x)
    adv_BT = torch.zeros_like(x.values_BT)
    next_adv_B = next_value_B = torch.zeros_like(x.rewards_B)
    for t in reversed(range(mask_BT.shape[1])):
        m_B, v_B = mask_BT[:, t], x.values_BT[:, t]
        delta_B = r_BT[:, t] + x.gamma * next_value_B - v_B
        next_adv_B = torch.where(m_B, delta_B + x.gamma * x.lam * next_adv_B, next_adv_B)
        next_value_B = torch.where(m_B, v_B, next_value_B)
        adv_BT[:, t] = next_adv_B * m_B
    return adv_BT


def gae_returns(x: AdvantageInputs) -> torch.Tensor:
    """Value targets for the critic: R_t = A_t + V_t (the TD(lambda) return), zero off-mask."""
    return (gae(x) + x.values_BT) * x.mask_BT


@estimator("on_policy_distill")
def on_policy_distill(x: AdvantageInputs) -> torch.Tensor:
    """A_t = -(log p_student(y_t) - log p_teacher(y_t)): minus the per-token reverse-KL
    estimate on the student's own samples. Needs no reward."""
    return (x.teacher_logprobs_BT - x.logprobs_BT) * x.mask_BT


@estimator("turn_rloo")
def turn_rloo(x: AdvantageInputs) -> torch.Tensor:
    """Per-turn leave-one-out. Each maximal run of loss tokens is a turn; every token of turn k
    of rollout i gets A_ik = G_ik - b_ik: G_ik is the return from the turn's first token and
    b_ik the mean of G_jk over the group's other rollouts j that reached turn k (0 if none).

    b_ik depends only on other, independent rollouts and on "i reached turn k", settled before
    turn k's action, so the estimator is unbiased and adds no push toward longer or shorter
    episodes that the reward does not ask for. Rollouts that stopped earlier are left out of
    turn k's baseline (counting them as 0 is unbiased too, but noisier); i itself is left out
    (else its own later actions enter its baseline). Derivation: docs/algorithms.md.
    """
    mask_BT = x.mask_BT.bool()
    start_BT = mask_BT & ~torch.nn.functional.pad(mask_BT, (1, -1))
    turn_BT = start_BT.cumsum(1) * mask_BT  # k = 1, 2, ... on turn k's tokens, 0 off the mask
    at_BT, r_BT = turn_BT * start_BT, returns_BT(x) * start_BT  # column 0 collects nothing
    G_BK = r_BT.new_zeros(len(mask_BT), int(turn_BT.max()) + 1).scatter_add_(1, at_BT, r_BT)
    reached_BK = torch.zeros_like(G_BK).scatter_add_(1, at_BT, start_BT.to(G_BK.dtype))
    others_BB = (x.group_B[:, None] == x.group_B[None, :]).fill_diagonal_(False).to(G_BK.dtype)
    b_BK = others_BB @ G_BK / (others_BB @ reached_BK).clamp(min=1)
    return (G_BK - b_BK).gather(1, turn_BT) * x.mask_BT


def dynamic_filter(rewards_B: torch.Tensor, group_B: torch.Tensor) -> torch.Tensor:
    """keep_B: False for every rollout of a group whose rewards are all equal (no signal)."""
    same_BB = group_B[:, None] == group_B[None, :]
    return (same_BB & (rewards_B[:, None] != rewards_B[None, :])).any(1)


# -- from samples ---------------------------------------------------------------------------

def turn_rewards(s) -> list[float]:
    """A Sample's per-turn rewards on the last token of each generated span, if the agent
    reported one per span (`info["turn_rewards"]`); otherwise an empty list."""
    ends = [i for i, m in enumerate(s.loss_mask) if m and (i + 1 == len(s.loss_mask)
                                                          or not s.loss_mask[i + 1])]
    given = s.info.get("turn_rewards", [])
    if len(given) != len(ends):
        return []
    out = [0.0] * len(s.tokens)
    for i, r in zip(ends, given):
        out[i] = r
    return out


def sample_advantages(samples: list, a, per_token: dict[str, list[list[float]]],
                      kl_penalty: list[list[float]] | None = None, max_tokens: int = 0
                      ) -> tuple[list[list[float]], list[list[float]] | None]:
    """Per-token advantages of each Sample by `a.estimator` (`a`: an AlgoConfig), and the
    critic's value targets for gae (else None).

    A rollout is one row (its segments concatenated), so it counts once in its group.
    `per_token` holds, per Sample, "logprobs" (behaviour) and where needed "values" (critic)
    and "teacher_logprobs". The rewards are shaped first (`shaped_rewards_BT`; the rollout's
    total becomes the sum of its shaped rewards); `kl_penalty` (per Sample, per token,
    already scaled) is then taken out of them: from the per-token rewards and from the
    rollout's total. The advantages are whitened last, if `a.whiten` asks.
    """
    rows: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        rows.setdefault(s.rollout_id, []).append(i)
    T = max(sum(len(samples[i].tokens) for i in idx) for idx in rows.values())

    def stack(per_sample) -> torch.Tensor:
        flat = [[v for i in idx for v in per_sample[i]] for idx in rows.values()]
        return torch.tensor([r + [0.0] * (T - len(r)) for r in flat], dtype=torch.float32)

    firsts = [samples[idx[0]] for idx in rows.values()]
    groups = {g: k for k, g in enumerate(dict.fromkeys(s.group_id for s in firsts))}
    mask_BT = stack([[float(m) for m in s.loss_mask] for s in samples])
    turns = [turn_rewards(s) for s in samples]
    token_rewards_BT = stack(turns) if all(turns) else None
    rewards_B = torch.tensor([s.reward for s in firsts])
    group_B = torch.tensor([groups[s.group_id] for s in firsts])
    if a.overlong_buffer or a.reward_scale != 1 or a.reward_clip:
        token_rewards_BT = shaped_rewards_BT(AdvantageInputs(rewards_B, group_B, mask_BT,
                                                             token_rewards_BT), a, max_tokens)
        rewards_B = token_rewards_BT.sum(1)
    if kl_penalty is not None:
        kl_BT = stack(kl_penalty) * mask_BT
        token_rewards_BT = rewards_BT(AdvantageInputs(rewards_B, group_B, mask_BT,
                                                      token_rewards_BT)) - kl_BT
        rewards_B = rewards_B - kl_BT.sum(1)
    x = AdvantageInputs(rewards_B, group_B, mask_BT, token_rewards_BT, values_BT=stack(per_token["values"])
                        if "values" in per_token else None,
                        logprobs_BT=stack(per_token["logprobs"]),
                        teacher_logprobs_BT=stack(per_token["teacher_logprobs"])
                        if "teacher_logprobs" in per_token else None, gamma=a.gamma, lam=a.lam)
    adv_BT = ESTIMATORS[a.estimator](x)
    if a.whiten != "off":
        adv_BT = whiten(adv_BT, mask_BT, group_B if a.whiten == "group" else 0 * group_B)
    returns_BT = gae_returns(x) if a.estimator == "gae" else None

    def unstack(x_BT: torch.Tensor) -> list[list[float]]:
        out: list = [None] * len(samples)
        for row, idx in zip(x_BT.tolist(), rows.values()):
            at = 0
            for i in idx:
                out[i], at = row[at:at + len(samples[i].tokens)], at + len(samples[i].tokens)
        return out
    return unstack(adv_BT), None if returns_BT is None else unstack(returns_BT)


def informative(samples: list) -> list:
    """The Samples of groups whose rollouts' rewards are not all equal (`dynamic_filter`)."""
    firsts = list({s.rollout_id: s for s in samples}.values())
    groups = {g: k for k, g in enumerate(dict.fromkeys(s.group_id for s in firsts))}
    keep_B = dynamic_filter(torch.tensor([s.reward for s in firsts]),
                            torch.tensor([groups[s.group_id] for s in firsts]))
    kept = {s.rollout_id for s, k in zip(firsts, keep_B.tolist()) if k}
    return [s for s in samples if s.rollout_id in kept]
