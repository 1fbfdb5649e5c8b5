"""instar: train LLM agents with reinforcement learning. The agent is an ordinary program."""

from instar.agents.contract import Action, ChatAgent, ChatContext, Env, Result, Task
from instar.agents.judge import Judge, parse_score
from instar.errors import InfraError

__all__ = ["Action", "ChatAgent", "ChatContext", "Env", "InfraError", "Judge", "Result", "Task",
           "parse_score"]
