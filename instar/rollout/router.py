"""Spread episodes over a pool of engines; keep each episode on one engine.

An episode's first request goes to the engine with the fewest live episodes; its later
turns go to the same engine, whose prefix cache already holds the conversation.

An engine that dies is restarted by Ray (from the base checkpoint); the router then gives it
the current weights before it serves again (the `reload` published with them: the version's
files, or, over NCCL/IPC, a send from the trainer; see instar/weight_sync.py), and the
episodes it was running are restarted. An engine that hangs (it has requests but generates
no token for `hang_s`, or stops answering) is killed by the router's watchdog and then
restarted the same way. An engine never generates with weights older than the run's current
version (`Versions`).

Every request of an episode is seeded from the run seed, the episode's key (its rollout id)
and the request's index in the episode (`request_seed`), so what it samples does not depend
on which engine or batch served it: a resumed run, on fresh engines, samples as the
uninterrupted one. A request's own seed (a ChatAgent client's) wins.
"""

import asyncio
import hashlib
import logging
import time

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from instar.errors import EpisodeError, Requeue
from instar.rollout.versions import POLICY, Versions

log = logging.getLogger(__name__)


def request_seed(seed: int, episode: str, index: int) -> int:
    """The sampling seed (63 bits) of request `index` (0, 1, ...) of `episode` in a run."""
    digest = hashlib.blake2b(f"{seed}/{episode}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


async def _streamed(refs, on_text):
    """The Generation a streaming engine call ends with; each text piece before it to `on_text`."""
    async for ref in refs:
        if isinstance(item := await ref, str):
            on_text(item)
    return item


class Router:
    def __init__(self, engines: list, versions: Versions, policy: str = POLICY,
                 hang_s: float = 120.0, seed: int = 0):
        self.engines, self.versions, self.policy, self.seed = engines, versions, policy, seed
        self.hang_s, self.watchdog = hang_s, None
        self.live = [0] * len(engines)
        """Episodes currently assigned to each engine."""
        self.assigned: dict[str, int] = {}
        self.recovering: dict[int, asyncio.Future] = {}
        self.requests: dict[str, int] = {}
        """Requests sent so far per episode (the index of its next one's seed)."""

    def engine_of(self, episode: str) -> int:
        if episode not in self.assigned:
            i = min(range(len(self.engines)), key=self.live.__getitem__)
            self.assigned[episode] = i
            self.live[i] += 1
        return self.assigned[episode]

    async def generate(self, episode: str, ids: list[int], sampling: dict,
                       images: list[str] = (), on_text=None):
        """One turn of `episode` on its engine (`images`: data URLs, one per placeholder in
        `ids`); raises Requeue if a weight update stopped it or its engine died, EpisodeError
        if the model sampled an image placeholder (see `Engine.generate`). `on_text`: called
        with each piece of the reply's text as it settles (see `Engine.stream`)."""
        if self.watchdog is None and self.hang_s:
            self.watchdog = asyncio.ensure_future(self.watch())
        i = self.engine_of(episode)
        n = self.requests.get(episode, 0)
        self.requests[episode] = n + 1
        sampling = {"seed": request_seed(self.seed, episode, n), **sampling}
        if i in self.recovering:
            await asyncio.shield(self.recovering[i])
        method = self.engines[i].generate if on_text is None else self.engines[i].stream
        call = method.remote(ids, sampling, self.versions[self.policy], images, self.policy)
        try:
            gen = await (call if on_text is None else _streamed(call, on_text))
        except RayActorError:
            gen = None
        except asyncio.CancelledError:  # (the client went away): the engine stops generating
            ray.cancel(call)
            raise
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
        many episodes noticed). If the current version can no longer be had (the trainer has
        stepped since: GPU transports), wait for the next one, whose sync brings it."""
        async def recover():
            try:
                while True:  # "unavailable" while Ray restarts it; "died" once it gives up
                    try:
                        await self.engines[i].__ray_ready__.remote()
                        break
                    except ActorUnavailableError:
                        await asyncio.sleep(1)
                version = self.versions[self.policy]
                reload = self.versions.reload.get(self.policy)
                if reload and not await reload(i):
                    async with self.versions.changed:
                        await self.versions.changed.wait_for(
                            lambda: self.versions[self.policy] > version)
            finally:
                del self.recovering[i]
        if i not in self.recovering:
            self.recovering[i] = asyncio.ensure_future(recover())
        await asyncio.shield(self.recovering[i])

    async def watch(self) -> None:
        """The watchdog: every engine that has requests in flight must generate a token (or
        answer at all) within `hang_s`; one that does not is killed, for Ray to restart.
        An idle engine, or one loading weights, is not hung."""
        seen: dict[int, tuple] = {}  # engine -> (its last progress, since when)
        while True:
            await asyncio.sleep(self.hang_s / 4)
            for i, engine in enumerate(self.engines):
                try:
                    live, tokens, loading = await asyncio.wait_for(engine.progress.remote(),
                                                                   self.hang_s)
                except RayActorError:
                    live = 0  # dead or restarting: its callers recover it
                except Exception:  # (a timeout, or it fails to say)
                    live, tokens, loading = 1, None, False
                if not live or loading or i in self.recovering:
                    seen.pop(i, None)
                    continue
                last, since = seen.get(i, (None, time.monotonic()))
                if tokens is not None and tokens != last:
                    seen[i] = (tokens, time.monotonic())
                elif time.monotonic() - since < self.hang_s:
                    seen[i] = (last, since)
                else:
                    log.warning(f"engine {i} generated nothing for {self.hang_s:.0f}s with "
                                f"{live} requests in flight: restarting it")
                    seen.pop(i)
                    self.replace(i)

    def replace(self, i: int) -> None:
        """Kill engine i; Ray restarts it, and its callers' `generate` recover it."""
        ray.kill(self.engines[i], no_restart=False)

    async def close(self) -> None:
        """Stop the watchdog."""
        if self.watchdog is not None:
            self.watchdog.cancel()
            await asyncio.gather(self.watchdog, return_exceptions=True)

    def release(self, episode: str) -> None:
        """The episode is over (a restarted one starts again from the same seeds)."""
        self.requests.pop(episode, None)
        i = self.assigned.pop(episode, None)
        if i is not None:
            self.live[i] -= 1
