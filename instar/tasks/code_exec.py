"""The built-in code-execution task: the model writes a Python function; tests run it.

    reset   "Write a Python function f(x) that returns x plus 7. Reply with the code only."
    step    the reply (or its ```python block) -> solution.py; the task's tests run against it
            in the sandbox (instar/tasks/sandbox.py: CPU, memory, wall-clock, output and
            process limits, no network, nothing outside its folder)
            all passed, or the last attempt  -> the episode ends
            otherwise                        -> the observation is "2 of 4 tests passed" and
                                                the first errors; the model tries again

Reward: the fraction of tests the last attempt passed. Each turn's reward is its change over
the previous attempt, so the sum (the episode's reward) is the last fraction whichever turn
the episode ends on. Code that crashes, loops, forks or floods its output earns what its
tests earned before it was stopped (usually 0) and its `info["violation"]` says which limit
stopped it; the run goes on. Data: `python -m instar.tasks.code_exec_data`. A ChatAgent doing
the same through the OpenAI SDK: `examples/code_exec_openai.py`.

The tests run in the same process as the code, so code written to do so could forge its
results; a per-run nonce on the result lines stops accidental forgery, not a determined one.
"""

import asyncio
import json
import re
import secrets

from instar import Action, Env, Result, Task
from instar.tasks.sandbox import ExecResult, run_code

# main.py in the sandbox: import the solution, run each test, one result line per test.
# Resource errors are re-raised: the sandbox reports them as violations.
HARNESS = """\
import json, sys
nonce = sys.stdin.readline().strip()
tests = json.load(open("tests.json"))
try:
    import solution
except BaseException:
    print("the code does not run:", file=sys.stderr)
    raise
for i, test in enumerate(tests):
    try:
        exec(test, dict(vars(solution)))
        print(nonce, i, "pass", flush=True)
    except (MemoryError, OSError):
        raise
    except BaseException as e:
        print(f"{test}  ->  {type(e).__name__}: {e}"[:200], file=sys.stderr, flush=True)
"""

_FENCE = re.compile(r"```(?:python|py)?\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The first fenced code block of a reply, or the whole reply."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


def run_tests(code: str, tests: list[str], **limits) -> tuple[int, ExecResult]:
    """Run `tests` (Python statements, e.g. `assert f(2) == 9`) against `code` in the
    sandbox; how many passed, and the run. `limits` go to `run_code`."""
    nonce = secrets.token_hex(8)
    run = run_code(HARNESS, stdin=nonce + "\n", **limits,
                   files={"solution.py": code, "tests.json": json.dumps(tests)})
    passed = {line for line in run.stdout.splitlines()  # a set: forked copies repeat lines
              if line.startswith(nonce + " ") and line.endswith(" pass")}
    return len(passed), run


def feedback(passed: int, total: int, run: ExecResult) -> str:
    """What the model reads after a failed attempt."""
    text = f"{passed} of {total} tests passed."
    if run.violation:
        text += f" The run was stopped by the {run.violation} limit."
    errors = run.stderr.strip()[-300:]
    return text + (f"\n{errors}" if errors else "") + "\nReply with the corrected function."


class CodeExec(Env):
    max_turns = 2
    limits = dict(cpu_s=2.0, wall_s=10.0, memory_mb=256)
    """Sandbox limits of one test run (see `run_code`)."""

    async def reset(self, task: Task):
        self.tests, self.last, self.attempts = task.data["tests"], 0.0, 0
        return task.prompt

    async def step(self, action: Action) -> Result:
        self.attempts += 1
        passed, run = await asyncio.to_thread(run_tests, extract_code(action.text), self.tests,
                                              **self.limits)
        fraction = passed / len(self.tests)
        reward, self.last = fraction - self.last, fraction
        info = {"passed": passed, "tests": len(self.tests), "attempts": self.attempts,
                "exit_code": run.returncode, "violation": run.violation or "",
                "exec_s": run.seconds}
        if passed == len(self.tests) or self.attempts >= self.max_turns:
            return Result(reward=reward, info=info)
        return Result(reward=reward, observation=feedback(passed, len(self.tests), run),
                      terminated=False, info=info)


AgentRunner = CodeExec
