"""Run one `Env` episode against a token-in/token-out generate function; return a Sample.

    reset(task) -> messages --chat template--> prompt ids
    loop:  generate(ids) -> sampled ids (+ log-probs, versions)        loss_mask 1
           step(Action)  -> Result(reward, observation)
           observation --chat template--> ids appended                 loss_mask 0

Every message, observations included, is rendered by the model's own chat template; the
sampled ids are appended as they are, never re-tokenised. Images (image parts of the
messages, `Result.images`) go to the engine with every turn; the engine expands their
placeholders, and the episode continues from the expanded prompt it reports.

The agent's own code (reset, step, parse_tool_calls) runs on the episode's `AgentThread`;
the loop above, and so the engine calls, stays on the caller's (the rollout) event loop.
"""

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from instar.agents.chat import as_messages, continuation_ids, prompt_ids
from instar.agents.contract import Action, Env, Task
from instar.agents.images import image_urls, with_images
from instar.errors import EpisodeError, InfraError
from instar.sample import Sample, fit_routing

log = logging.getLogger(__name__)
CANCEL_GRACE_S = 5.0
"""Seconds agent code left running after its episode (a timeout, tasks it started) has to
finish once cancelled, before its event loop stops for good."""
MAX_IDLE_THREADS = 512
"""Agent threads kept for later episodes (a rollout runs at most 256 per engine at once)."""


class Generated(Protocol):
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str
    routed_experts: list | None
    prompt_ids: list[int] | None
    """With images: the prompt as the engine expanded it."""
    reasoning: str | None
    content: str | None
    """`text` without reasoning and tool-call markup (None: not parsed)."""
    tool_calls: list[dict]
    tool_call_errors: int


Generate = Callable[[list[int], dict[str, Any], list[str]], Awaitable[Generated]]
"""generate(prompt ids, sampling, images as data URLs)"""


async def _await(fn, *args):
    try:
        return await fn(*args)
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # the deadline (or the run) cancelled it
            raise
        raise RuntimeError("the agent raised CancelledError") from None  # (not to the run)


class AgentThread:
    """One episode's agent code, on an event loop of its own in a daemon thread of its own.

    The rollout loop only awaits it, so agent code that blocks its thread (`time.sleep`, a
    busy loop) or ignores cancellation holds up neither other episodes nor deadlines: at the
    deadline the episode is abandoned. Python cannot kill a thread: a blocked one runs on
    until its call returns; then its tasks are cancelled and its loop stops (after
    CANCEL_GRACE_S for tasks that ignore cancellation). Needs only threads, so it works in
    any process with an event loop. A thread whose episode ended cleanly (nothing of the
    agent's left running on its loop) waits, renamed "agent (idle)", for the next episode:
    starting a thread and a loop per episode cost about 1.3 ms, most of a small model's turn.
    """

    idle: list["AgentThread"] = []
    lock = threading.Lock()

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, name: str) -> "AgentThread":
        """An idle thread, renamed `name`, or a new one."""
        with cls.lock:
            agent = cls.idle.pop() if cls.idle else None
        if agent is None:
            return cls(name)
        agent.thread.name = name
        return agent

    def _main(self) -> None:
        self.loop.run_forever()  # until close()
        left = asyncio.all_tasks(self.loop)  # cancelled at the deadline, or started by the agent
        for task in left:
            task.cancel()
        if left and self.loop.run_until_complete(asyncio.wait(left, timeout=CANCEL_GRACE_S))[1]:
            log.warning("%s: agent code ignored cancellation for %ss; its loop stops, so it "
                        "never resumes", threading.current_thread().name, CANCEL_GRACE_S)
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()  # (and its executor, that of asyncio.to_thread, without waiting)

    async def call(self, fn, *args):
        """`await fn(*args)` on the agent's loop. What it raises costs this rollout only
        (EpisodeError "agent_error"); engine errors never pass through here."""
        try:
            return await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(_await(fn, *args), self.loop))
        except InfraError as e:
            raise EpisodeError("infra", f"{type(e).__name__}: {e}") from e
        except Exception as e:
            raise EpisodeError("agent_error", f"{type(e).__name__}: {e}") from e

    def close(self) -> None:
        """The episode is over (or abandoned): once the loop is free, it waits for the next
        episode if the agent left nothing running on it, else it stops."""
        self.loop.call_soon_threadsafe(self._release)

    def _release(self) -> None:  # (on the agent's loop)
        with AgentThread.lock:
            if not asyncio.all_tasks(self.loop) and len(AgentThread.idle) < MAX_IDLE_THREADS:
                self.thread.name = "agent (idle)"
                AgentThread.idle.append(self)
                return
        self.loop.stop()


async def _step(env: Env, gen: Generated):  # (parse_tool_calls, overridable, is agent code too)
    calls = env.parse_tool_calls(gen.text)  # None: the engine's parse
    return await env.step(Action(gen.text, list(gen.token_ids),
                                 list(gen.tool_calls) if calls is None else calls, gen.reasoning,
                                 gen.text if gen.content is None else gen.content))


async def _episode(env: Env, task: Task, generate: Generate, tokenizer,
                   sampling: dict[str, Any], call, at: list) -> dict:
    at[:] = "in the agent's reset", time.monotonic()  # (where it is: told if it times out)
    messages = as_messages(await call(env.reset, task))
    images = image_urls(messages)
    tokens = prompt_ids(tokenizer, messages, env.tools)
    mask, logprobs, versions = [False] * len(tokens), [None] * len(tokens), [None] * len(tokens)
    reward, turn_rewards, info, finish, routing = 0.0, [], {}, "max_turns", None
    call_errors = calls = 0
    for turn in range(1, env.max_turns + 1):
        budget = env.max_tokens - len(tokens)
        if budget <= 0:
            finish = "max_tokens"
            break
        at[:] = f"with the engine (turn {turn})", time.monotonic()
        gen = await generate(tokens, {**sampling, "max_tokens": min(sampling["max_tokens"], budget)},
                             images)
        if gen.prompt_ids is not None:  # new image placeholders (in the last observation) expanded
            grown = len(gen.prompt_ids) - len(tokens)
            tokens, mask = list(gen.prompt_ids), mask + [False] * grown
            logprobs, versions = logprobs + [None] * grown, versions + [None] * grown
        n = len(gen.token_ids)
        tokens += gen.token_ids
        mask += [True] * n
        logprobs += gen.logprobs
        versions += gen.versions
        seen = (len(tokens), len(images))  # what the engine has seen (and expanded)
        routing = gen.routed_experts  # every position the engine has run (GPU MoE only)
        call_errors += gen.tool_call_errors
        calls += len(gen.tool_calls)
        at[:] = f"in the agent's step (turn {turn})", time.monotonic()
        result = await call(_step, env, gen)
        reward += result.reward
        turn_rewards.append(result.reward)
        info.update(result.info)
        if result.terminated or result.truncated:
            finish = gen.finish_reason if result.terminated else "truncated"
            break
        if gen.finish_reason != "stop" or result.observation is None:
            finish = gen.finish_reason if gen.finish_reason != "stop" else "no_observation"
            break
        before = messages + [{"role": "assistant", "content": gen.text}]
        new = with_images(as_messages(result.observation), result.images)
        messages, images = before + new, images + image_urls(new)
        obs = continuation_ids(tokenizer, before, messages, env.tools,
                               gen.token_ids[-1:] == [tokenizer.eos_token_id])
        if obs is None:
            raise EpisodeError("template", "the chat template re-renders earlier turns")
        tokens += obs
        mask += [False] * len(obs)
        logprobs += [None] * len(obs)
        versions += [None] * len(obs)
    if not any(mask):
        raise EpisodeError("max_tokens", f"the prompt alone exceeds max_tokens={env.max_tokens}")
    if len(images) > seen[1]:  # a last observation with images the engine never expanded
        tokens, mask, logprobs, versions = (x[:seen[0]] for x in (tokens, mask, logprobs, versions))
        images = images[:seen[1]]
    return dict(tokens=tokens, loss_mask=mask, logprobs=logprobs, versions=versions,
                reward=reward, finish_reason=finish,
                info={**info, "turn_rewards": turn_rewards, "tool_call_errors": call_errors,
                      **({"parsed_tool_calls": calls} if env.tools else {})},  # (offered tools)
                routed_experts=fit_routing(routing, len(tokens)), images=images or None)


async def run_env_episode(env: Env, task: Task, generate: Generate, tokenizer,
                          sampling: dict[str, Any], rollout_id: str, group_id: str) -> Sample:
    """One episode as one Sample; raises EpisodeError if the agent fails or times out.

    Errors of `generate` (the engine) propagate unchanged: they are not the agent's. The
    deadline holds even while `step` blocks its thread: see `AgentThread`.
    """
    agent, at = AgentThread.start(f"agent {rollout_id}"), []
    try:
        ep = await asyncio.wait_for(_episode(env, task, generate, tokenizer, sampling,
                                             agent.call, at), timeout=env.timeout_s)
    except TimeoutError as e:
        raise EpisodeError("timeout", f"episode ran over {env.timeout_s}s; {at[0]} for the "
                                      f"last {time.monotonic() - at[1]:.1f}s") from e
    finally:
        agent.close()
    return Sample(rollout_id=rollout_id, group_id=group_id, task_id=task.id, segment=0,
                  sampling=sampling, **ep)
