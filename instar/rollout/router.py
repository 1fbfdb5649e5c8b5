"""Spread episodes over a pool of engines; keep each episode on one engine.

An episode's first request goes to the engine with the fewest live episodes; its later
turns go to the same engine, whose prefix cache already holds the conversation.

An engine that dies is restarted by Ray (from the base checkpoint); the router then loads
the current weights into it before it serves again, and the episodes it was running are
restarted. An engine never generates with weights older than the run's current version
(`Versions`).
"""

import asyncio

from ray.exceptions import ActorUnavailableError, RayActorError

from instar.errors import EpisodeError, Requeue
from instar.rollout.versions import POLICY, Versions


class Router:
    def __init__(self, engines: list, versions: Versions, policy: str = POLICY):
        self.engines, self.versions, self.policy = engines, versions, policy
        self.live = [0] * len(engines)
        """Episodes currently assigned to each engine."""
        self.assigned: dict[str, int] = {}
        self.recovering: dict[int, asyncio.Future] = {}

    def engine_of(self, episode: str) -> int:
        if episode not in self.assigned:
            i = min(range(len(self.engines)), key=self.live.__getitem__)
            self.assigned[episode] = i
            self.live[i] += 1
        return self.assigned[episode]

    async def generate(self, episode: str, ids: list[int], sampling: dict,
                       images: list[str] = ()):
        """One turn of `episode` on its engine (`images`: data URLs, one per placeholder in
        `ids`); raises Requeue if a weight update stopped it or its engine died, EpisodeError
        if the model sampled an image placeholder (see `Engine.generate`)."""
        i = self.engine_of(episode)
        if i in self.recovering:
            await asyncio.shield(self.recovering[i])
        try:
            gen = await self.engines[i].generate.remote(ids, sampling,
                                                        self.versions[self.policy], images)
        except RayActorError:
            gen = None
        if gen is None or gen.finish_reason == "behind":  # died, or restarted with old weights
            await self._recover(i)
            raise Requeue(f"engine {i} was restarted during episode {episode}")
        if gen.finish_reason == "abort":
            raise Requeue(f"episode {episode} was stopped by a weight update")
        if gen.finish_reason == "placeholder":
            raise EpisodeError("placeholder", "the model sampled an image placeholder token")
        return gen

    async def _recover(self, i: int) -> None:
        """Wait for Ray to restart engine i, then give it the current weights (once, however
        many episodes noticed)."""
        async def reload():
            try:
                while True:  # "unavailable" while Ray restarts it; "died" once it gives up
                    try:
                        await self.engines[i].__ray_ready__.remote()
                        break
                    except ActorUnavailableError:
                        await asyncio.sleep(1)
                if weights := self.versions.weights.get(self.policy):
                    await self.engines[i].load_weights.remote(weights, self.versions[self.policy])
            finally:
                del self.recovering[i]
        if i not in self.recovering:
            self.recovering[i] = asyncio.ensure_future(reload())
        await asyncio.shield(self.recovering[i])

    def release(self, episode: str) -> None:
        i = self.assigned.pop(episode, None)
        if i is not None:
            self.live[i] -= 1
