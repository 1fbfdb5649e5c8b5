"""Weights from the trainer to the engines, and the check that they arrived.

    sync_weights(trainer, engines, folder, v, ...)   each rank's shards -> /dev/shm -> every
                                                     engine's reload_weights (or NCCL / IPC)
        -> reload: how an engine Ray restarts later gets version v (`Rollouts.publish`)
        -> ProbeCheck: every engine scores a fixed probe sequence (already running)
    check.result()                                   waits once; raises if an engine's log-probs
                                                     differ from the trainer's by more than tol

The loop waits for the check only before the new weights' tokens are trained on or
evaluated, so the engines' probe overlaps the next rollouts.

A restarted engine holds the base checkpoint until the router calls `reload(i)`. File
transport: it loads version v's files, kept in `folder` until the next sync. GPU transports
keep no copy: the trainer's ranks link the new incarnation and send it their weights, if they
still are version v (see `Trainer.resend`: the loop waits on rollouts only then). Once the
trainer has stepped they are not: the engine waits for the next sync, which links every
restarted engine before it sends (in the meantime the loop is training, not waiting on it).
"""

import os
import time

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from instar.rollout.versions import POLICY, Reload
from instar.train import lora
from instar.train.trainer import Trainer

DEADLINE_S = 900
"""An engine that takes longer over a weight load or a probe is taken for hung: it is killed
(Ray restarts it) and called again."""


def on_engines(engines: list, method: str, *args, refs: list | None = None) -> list:
    """Call `method` on every engine (or collect `refs`, the calls already made); an engine
    that died, or hung past the deadline, is waited for (Ray restarts it) and called again."""
    out = []
    for e, ref in zip(engines, refs or [getattr(e, method).remote(*args) for e in engines]):
        try:
            out.append(ray.get(ref, timeout=DEADLINE_S))
        except (RayActorError, GetTimeoutError) as err:
            if isinstance(err, GetTimeoutError):
                ray.kill(e, no_restart=False)
            wait_restarted(e)
            out.append(ray.get(getattr(e, method).remote(*args), timeout=DEADLINE_S))
    return out


def wait_restarted(engine) -> None:
    """Block until Ray has restarted `engine` ("unavailable" meanwhile; "died" if it gave up)."""
    while True:
        try:
            return ray.get(engine.__ray_ready__.remote())
        except ActorUnavailableError:
            time.sleep(1)


class ProbeCheck:
    """The engines scoring `probe` (started now); `result()` waits for them once and returns
    the largest |engine - trainer| log-prob difference, or raises if it is over `tol`: that
    engine does not hold the trainer's weights."""

    def __init__(self, engines: list, probe: list[int], expected: list[float], tol: float,
                 policy: str = POLICY):
        self.engines, self.probe, self.expected, self.tol = engines, probe, expected, tol
        self.policy = policy
        self.refs = [e.prompt_logprobs.remote(probe, policy) for e in engines]
        self.worst: float | None = None

    def result(self) -> float:
        if self.worst is None:
            got = on_engines(self.engines, "prompt_logprobs", self.probe, self.policy,
                             refs=self.refs)
            diffs = [max(abs(a - b) for a, b in zip(g[1:], self.expected[1:])) for g in got]
            for i, diff in enumerate(diffs):
                if diff > self.tol:
                    raise RuntimeError(
                        f"weight sync check failed: on the probe sequence engine {i}'s log-probs "
                        f"differ from the trainer's by {diff:.2e} (> {self.tol:.0e}, "
                        "--rollout.sync-check-tol); the engine does not hold the trainer's "
                        "weights (a broken transfer, or a layer the engine did not reload)")
            self.worst = max(diffs)
        return self.worst


def sync_weights(trainer: Trainer, engines: list, folder: str, version: int, probe: list[int],
                 tol: float, transport: str = "file", policy: str = POLICY
                 ) -> tuple[Reload, ProbeCheck, int]:
    """Push the trainer's weights into every engine as `version` of `policy` (several LoRA
    adapters: each is a policy of its own). Returns how an engine that
    restarts later gets them (see the module docstring), the engines' probe check, already
    running (wait for it before the new weights' tokens are trained on or evaluated), and
    the bytes sent to each engine."""
    if trainer.lora or transport == "file":
        if trainer.lora:  # only the adapter, through Ray's object store (any node)
            adapter = trainer.adapter()
            method, size = "load_adapter", lora.num_bytes(adapter)
            args = ray.put(adapter), version, policy
        else:  # each rank's shards through `folder` (RAM), into reload_weights
            method, args = "load_weights", (trainer.save_shards(folder), version)
            size = sum(os.path.getsize(p) for p in args[0])
        loads = [getattr(e, method).remote(*args) for e in engines]
        expected = trainer.probe(probe)  # while the engines load
        on_engines(engines, method, *args, refs=loads)  # (a restarted one too)

        async def reload(i: int) -> bool:
            await getattr(engines[i], method).remote(*args)
            return True
    else:  # device to device: NCCL or CUDA IPC
        trainer.link(on_engines(engines, "incarnation"))  # (a restarted engine: linked anew)
        ray.get([e.pause.remote(version) for e in engines])
        try:
            size = trainer.send_weights(version)
        finally:
            ray.get([e.resume.remote(version) for e in engines])
        expected = trainer.probe(probe)

        async def reload(i: int) -> bool:
            refs = trainer.resend(i, await engines[i].incarnation.remote(), version)
            if refs is None:
                return False
            for ref in refs:  # (the router holds the restarted engine's requests meanwhile)
                await ref
            await engines[i].resume.remote(version)  # it holds `version` from now on
            return True
    return reload, ProbeCheck(engines, probe, expected, tol, policy), size
