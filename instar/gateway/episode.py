"""Run one ChatAgent episode through the gateway; its captured segments become Samples.

`agent.run` runs wholly on the episode's own thread and event loop (`AgentThread`), so an
agent that blocks or ignores cancellation still ends at `timeout_s` and holds up no other.
"""

import asyncio

from instar.agents.contract import ChatAgent, ChatContext, Task
from instar.agents.env_loop import AgentThread
from instar.errors import EpisodeError, Requeue
from instar.gateway.server import Gateway
from instar.sample import Sample


async def run_chat_episode(agent: ChatAgent, task: Task, gateway: Gateway, sampling: dict,
                           rollout_id: str, group_id: str) -> list[Sample]:
    """One episode as its captured segments; raises EpisodeError if the agent fails."""
    sid = gateway.open_session(rollout_id, group_id, sampling, agent.max_turns, agent.max_tokens)
    openai_url, anthropic_url = gateway.urls(sid)
    ctx = ChatContext(task=task, openai_base_url=openai_url, anthropic_base_url=anthropic_url,
                      api_key=gateway.api_key, model=gateway.model, sampling=dict(sampling))
    thread = AgentThread.start(f"agent {rollout_id}")
    try:
        result = await asyncio.wait_for(thread.call(agent.run, ctx), agent.timeout_s)
        reward, info = result.reward, result.info
    except (TimeoutError, EpisodeError) as e:
        session = gateway.sessions[sid]
        if not session.requeued and session.failed is None:  # (else the run's doing: below)
            if isinstance(e, TimeoutError):
                raise EpisodeError("timeout", f"episode ran over {agent.timeout_s}s; "
                                       f"{session.where()}") from e
            if session.truncated is None:
                raise
        reward, info = 0.0, {}  # the agent stopped at a limit the gateway enforced
    finally:
        thread.close()
        session = gateway.close_session(sid)
    if session.requeued:
        raise Requeue(f"episode {rollout_id} was stopped by a weight update")
    if session.failed is not None:
        raise session.failed
    samples = session.samples(reward, info, task.id)
    if not samples:
        raise EpisodeError("no_generation", "the agent returned without calling the model")
    return samples
