"""How an episode can end early. Raised by the episode runners (the Env loop, the gateway) and
the router; caught by `Rollouts` (instar/rollout/runner.py), which counts the one and restarts
the other. No imports: agent-facing code and the rollout side both use them."""


class EpisodeError(Exception):
    """The episode failed (the agent raised or ran out of time, or the model produced what
    cannot go on): the rollout is dropped or retried, and counted by `reason`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class InfraError(Exception):
    """Raise it from an agent (an Env's `reset` or `step`, a ChatAgent's `run`) when the episode
    failed outside the model: a sandbox that would not start, a tool service that timed out.
    The rollout leaves its group, so its reward counts neither as 0 nor as the model's; it is
    counted as failed `infra` (rollout/failed/infra, rollout/infra_errors; --health.*)."""


class Requeue(Exception):
    """The infrastructure stopped the episode (a weight update with partial rollout off, an
    engine that died): it starts again from the beginning and is not a failure."""


class LayoutError(RuntimeError):
    """The Ray cluster cannot hold the engines and ranks the flags ask for; the message names
    the flags to change (the commands print it as one line and exit with code 2)."""
