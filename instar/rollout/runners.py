"""Agent runners: the episodes in other processes, on any node of the Ray cluster.

    driver (Stream, run) ──group(task, n)──> Runners ──> the least busy Runner actor
                                                          Rollouts: its own event loop, agent
                                                          threads and (ChatAgents) a gateway on
                                                          its node's 127.0.0.1 with its own key
                                                              │ token ids
                                                              ▼
                                                          the run's engines (shared)

The driver runs no agent code and serves no HTTP: it hands out groups and collects their
samples. A group stays on one runner, so every episode keeps to one engine (each runner's
router holds the affinity of its own episodes). Every call carries the versions the engines
hold (and how a restarted engine gets them), so a runner Ray restarts catches up with its
first group; `publish` tells the live ones at once, for the episodes they are running.

A runner that dies is an infrastructure failure, not the agents': its groups start again on
another runner (or on it, once Ray has restarted it), counted as restarted episodes.
"""

import asyncio
import logging

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from instar.agents.loading import load_agent
from instar.rollout.runner import MAX_RESTARTS, Batch, Rollouts, start_loop
from instar.rollout.versions import POLICY, Reload, Versions

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=-1)
class Runner:
    """One runner process: a `Rollouts` of the agent in `agent_file` (loaded here, so the
    agent's own imports resolve on this node)."""

    def __init__(self, agent_file: str, *args, **kwargs):
        self.rollouts = Rollouts(load_agent(agent_file), *args, **kwargs)

    async def _catch_up(self, held: dict[str, int], reload: dict[str, Reload | None]) -> None:
        r = self.rollouts
        for policy, version in held.items():
            if version > r.versions[policy]:
                await asyncio.wrap_future(r.submit(r.versions.advance(policy, version,
                                                                      reload.get(policy))))

    async def group(self, task, n: int, sampling: dict, tag: str, held: dict[str, int],
                    reload: dict[str, Reload | None]) -> Batch:
        await self._catch_up(held, reload)
        return await asyncio.wrap_future(self.rollouts.submit(
            self.rollouts.group(task, n, sampling, tag)))

    async def publish(self, held: dict[str, int], reload: dict[str, Reload | None]) -> None:
        await self._catch_up(held, reload)

    def close(self) -> None:
        self.rollouts.judge_engines = []  # (the driver's: it stops them)
        self.rollouts.close()


class Runners(Rollouts):
    """The driver's side: `Rollouts`' interface (group, run, publish, close), its episodes
    run by `count` Runner actors (each on a node with `resource`, if given)."""

    def __init__(self, count: int, resource: str, agent_file: str, agent_config: dict,
                 engines: list, tokenizer, **kwargs):
        self.versions, self.judge_engines = Versions(), kwargs.get("judge_engines") or []
        self.gateway = self.router = self.judge_router = None  # (all in the runners)
        self.loop = start_loop()
        options = {"resources": {resource: 0.001}} if resource else {
            "scheduling_strategy": "SPREAD"}
        self.actors = [Runner.options(**options).remote(
            agent_file, agent_config, engines, tokenizer, **kwargs) for _ in range(count)]
        self.busy = [0] * count
        """Groups in flight on each runner."""
        ray.get([a.__ray_ready__.remote() for a in self.actors])

    async def group(self, task, n: int, sampling: dict, tag: str) -> Batch:
        restarted, avoid = 0, None
        for _ in range(MAX_RESTARTS + 1):
            k = min((k for k in range(len(self.actors)) if k != avoid or len(self.actors) == 1),
                    key=self.busy.__getitem__)
            if k == avoid:  # the only runner: wait until Ray has restarted it
                await _restarted(self.actors[k])
            self.busy[k] += 1
            ref = self.actors[k].group.remote(task, n, sampling, tag, dict(self.versions.held),
                                              dict(self.versions.reload))
            try:
                batch = await ref
                batch.restarted += restarted
                return batch
            except RayActorError as e:
                log.warning(f"agent runner {k} failed ({type(e).__name__}): group {tag}-"
                            f"{task.id} starts again on another")
                restarted, avoid = restarted + n, k
            except asyncio.CancelledError:
                ray.cancel(ref)
                raise
            finally:
                self.busy[k] -= 1
        raise RuntimeError(f"group {tag}-{task.id} lost {MAX_RESTARTS + 1} agent runners")

    def publish(self, version: int, reload: Reload | None, policy: str = POLICY) -> None:
        super().publish(version, reload, policy)
        refs = [a.publish.remote(dict(self.versions.held), dict(self.versions.reload))
                for a in self.actors]
        for ref in refs:  # (a runner Ray is restarting catches up with its next group)
            try:
                ray.get(ref)
            except RayActorError:
                pass

    def close(self) -> None:
        for a in self.actors:
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:  # (dead, or stuck: it is killed below either way)
                pass
            ray.kill(a, no_restart=True)
        super().close()


async def _restarted(actor) -> None:
    while True:
        try:
            return await actor.__ray_ready__.remote()
        except ActorUnavailableError:
            await asyncio.sleep(1)
        except ActorDiedError as e:
            raise RuntimeError("the only agent runner died for good") from e
