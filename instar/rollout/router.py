"""Spread episodes over a pool of engines; keep each episode on one engine.

An episode's first request goes to the engine with the fewest live episodes; its later
turns go to the same engine, whose prefix cache already holds the conversation. The router
also remembers the version of each episode's first token, so an engine can refuse to
continue an episode that has become too stale (see `Engine.load_weights`).
"""

from instar.agents.env_loop import Requeue


class Router:
    def __init__(self, engines: list):
        self.engines = engines
        self.live = [0] * len(engines)
        """Episodes currently assigned to each engine."""
        self.assigned: dict[str, int] = {}
        self.oldest: dict[str, int] = {}

    def engine_of(self, episode: str) -> int:
        if episode not in self.assigned:
            i = min(range(len(self.engines)), key=self.live.__getitem__)
            self.assigned[episode] = i
            self.live[i] += 1
        return self.assigned[episode]

    async def generate(self, episode: str, ids: list[int], sampling: dict):
        """One turn of `episode` on its engine; raises Requeue if a weight update stopped it."""
        engine = self.engines[self.engine_of(episode)]
        gen = await engine.generate.remote(ids, sampling, self.oldest.get(episode))
        if gen.finish_reason == "abort":
            raise Requeue(f"episode {episode} was stopped by a weight update")
        if gen.versions:
            self.oldest.setdefault(episode, gen.versions[0])
        return gen

    def release(self, episode: str) -> None:
        self.oldest.pop(episode, None)
        i = self.assigned.pop(episode, None)
        if i is not None:
            self.live[i] -= 1
