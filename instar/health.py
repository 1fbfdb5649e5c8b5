"""Health gates: each step's rates that say a run is not learning what it should, checked
against --health.* (a threshold that warns, one that stops the run with a diagnosis).

    rollout/tool_parse_failures   tool calls the model began that did not parse
    rollout/tool_calls            parsed tool calls per episode (low: the model does not call)
    rollout/infra_errors          episodes lost to the infrastructure (InfraError: sandbox, tools)
    rollout/no_spread_groups      groups whose rollouts all got one reward (no learning signal)
    rollout/truncated             episodes that ran out of tokens

`instar rl` also checks the tool-call rates on the preflight's fresh samples, before step 1.
"""

from collections import Counter

from instar.config import HealthConfig
from instar.sample import Sample

CHECKS = {  # --health.<field>: (metric, low values are the bad ones, diagnosis)
    "tool_parse_failures": ("rollout/tool_parse_failures", False,
                            "{value:.0%} of the model's tool calls did not parse: check that "
                            "--model.tool-parser fits the model's tool-call format (instar "
                            "check-model DIR), or warm it up on tool-call examples"),
    "tool_calls": ("rollout/tool_calls", True,
                   "the model made {value:.2f} parsed tool calls per episode: it is not using "
                   "its tools (see the rollouts: instar view RUN)"),
    "infra_errors": ("rollout/infra_errors", False,
                     "{value:.0%} of episodes failed outside the model (InfraError: a sandbox "
                     "or a tool service); their tracebacks are in failed_rollouts.jsonl"),
    "no_spread_groups": ("rollout/no_spread_groups", False,
                         "{value:.0%} of groups gave all their rollouts one reward, so they "
                         "teach nothing: the task is too hard or too easy for the model now "
                         "(--algo.dynamic-filter refills such groups; a larger "
                         "--rollout.group-size finds more spread)"),
    "truncated": ("rollout/truncated", False,
                  "{value:.0%} of episodes ran out of tokens: raise --rollout.max-tokens or "
                  "the agent's max_tokens, or leave them out of the loss "
                  "(--algo.overlong-mask)"),
}


class HealthError(RuntimeError):
    """A rate passed its stop threshold; the message is the diagnosis."""


def rates(episodes: list[Sample], failed: Counter) -> dict[str, float]:
    """The tool-call and infrastructure rates of a step's episodes (one Sample each) and its
    failed rollouts (by reason); a rate with nothing to count is left out. The tool-call rates
    count the episodes that offered the model tools (their info has `parsed_tool_calls`): a
    model that begins a tool call in a task without tools is not a parser problem."""
    tooled = [s for s in episodes if "parsed_tool_calls" in s.info]
    calls = sum(s.info["parsed_tool_calls"] for s in tooled)
    errors = sum(s.info.get("tool_call_errors", 0) for s in tooled)
    out = {"rollout/tool_calls": calls / len(tooled)} if tooled else {}
    if calls + errors:
        out["rollout/tool_parse_failures"] = errors / (calls + errors)
    if episodes or failed:
        out["rollout/infra_errors"] = failed["infra"] / (len(episodes) + sum(failed.values()))
    return out


class Health:
    """Checks a step's metrics against the thresholds; remembers which rates are over their
    warning, so that each warns once when it crosses, and again only after it recovered."""

    def __init__(self, cfg: HealthConfig):
        self.thresholds = {"tool_parse_failures": cfg.tool_parse_failures,
                           "tool_calls": cfg.tool_calls, "infra_errors": cfg.infra_errors,
                           "no_spread_groups": cfg.no_spread_groups, "truncated": cfg.truncated}
        self.over: set[str] = set()

    def check(self, m: dict, step: int) -> list[str]:
        """The warnings of step `step`; raises HealthError if a rate passed its stop threshold."""
        warnings = []
        for name, (key, low, diagnosis) in CHECKS.items():
            if (value := m.get(key)) is None:
                continue
            warn, stop = self.thresholds[name]
            bad = (lambda t: value < t) if low else (lambda t: value > t)  # noqa: B023
            text = diagnosis.format(value=value)
            flag = f"--health.{name.replace('_', '-')}"
            if bad(stop):
                raise HealthError(f"health check failed at step {step}: {text} (stop threshold "
                                  f"{stop:g}, {flag})")
            if bad(warn) and name not in self.over:
                warnings.append(f"step {step}: {text} (warning threshold {warn:g}, {flag})")
            self.over = self.over | {name} if bad(warn) else self.over - {name}
        return warnings
