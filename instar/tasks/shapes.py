"""The built-in vision-language task: name the colour of a shape in an image, twice.

    user       [image: a red circle] What colour is the shape?
    assistant  red                                  -> turn reward 0.5
    user       [image: a blue square] And this one?  (the observation brings a new image)
    assistant  blue                                 -> turn reward 0.5

Each turn's reward is half the score of its answer: 1 when its first word is the colour,
else 0 (a colour is right or wrong: partial credit for letters in place paid RL for
non-words such as "gue" and "rererebblow"). Data (images drawn locally,
held-out shape/colour pairs): `python -m instar.tasks.shapes_data`. Needs a vision-language
model (`--model.kind vl`). The same task through the OpenAI SDK: examples/shapes_openai.py.
Written against the public contract, as a user would.
"""

from instar import Action, Env, Result, Task
from instar.tasks.shapes_data import draw


def score(answer: str, colour: str) -> float:
    return float((answer.split() or [""])[0].strip(".,!").lower() == colour)


class Shapes(Env):
    max_turns = 2
    max_tokens = 256

    async def reset(self, task: Task):
        self.shapes, self.turn = task.data["shapes"], 0
        return [{"role": "user", "content": [{"type": "image", "image": draw(*self.shapes[0])},
                                             {"type": "text", "text": task.prompt}]}]

    async def step(self, action: Action) -> Result:
        colour = self.shapes[self.turn][1]
        reward = score(action.text, colour) / len(self.shapes)
        self.turn += 1
        info = {"right": float(reward * len(self.shapes) == 1.0)}
        if self.turn == len(self.shapes):
            return Result(reward=reward, info=info)
        return Result(reward=reward, observation="And this one?", terminated=False, info=info,
                      images=[draw(*self.shapes[self.turn])])


AgentRunner = Shapes
