"""Spread episodes over a pool of engines; keep each episode on one engine.

An episode's first request goes to the engine with the fewest live episodes; its later
turns go to the same engine, whose prefix cache already holds the conversation.
"""


class Router:
    def __init__(self, engines: list):
        self.engines = engines
        self.live = [0] * len(engines)
        """Episodes currently assigned to each engine."""
        self.assigned: dict[str, int] = {}

    def engine_of(self, episode: str) -> int:
        if episode not in self.assigned:
            i = min(range(len(self.engines)), key=self.live.__getitem__)
            self.assigned[episode] = i
            self.live[i] += 1
        return self.assigned[episode]

    def generate(self, episode: str, ids: list[int], sampling: dict):
        """The engine call (an awaitable Ray ref) for one turn of `episode`."""
        return self.engines[self.engine_of(episode)].generate.remote(ids, sampling)

    def release(self, episode: str) -> None:
        i = self.assigned.pop(episode, None)
        if i is not None:
            self.live[i] -= 1
