"""The built-in default task: reverse a short string of letters.

The model sees "Reverse: abcd" and should answer "dcba". The reward is the fraction of
positions it gets right (a wrong length costs the missing or extra positions), so partial
answers earn partial credit. Written against the public contract, as a user would.
"""

from instar import Action, Env, Result, Task


def score(answer: str, label: str) -> float:
    answer = answer.strip()
    right = sum(a == b for a, b in zip(answer, label))
    return right / max(len(answer), len(label), 1)


class Reverse(Env):
    max_turns = 1

    async def reset(self, task: Task) -> str:
        self.label = task.label
        return task.prompt

    async def step(self, action: Action) -> Result:
        reward = score(action.text, self.label)
        return Result(reward=reward, info={"exact": float(reward == 1.0)})


AgentRunner = Reverse
