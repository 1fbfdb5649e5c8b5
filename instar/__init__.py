"""instar: train LLM agents with reinforcement learning. The agent is an ordinary program."""

from instar.agents.contract import Action, ChatAgent, ChatContext, Env, Result, Task

__all__ = ["Action", "ChatAgent", "ChatContext", "Env", "Result", "Task"]
