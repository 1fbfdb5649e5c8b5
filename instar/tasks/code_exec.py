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

Forgery: a test is a call and the value it must return, and only the call enters the sandbox.
The harness prints each call's value as JSON; the comparison happens here, outside the
sandbox, where the code can neither write nor trace. Code may print lines of its own (it can
read the nonce that tags the harness's lines), but a test passes only if exactly one value
came back for it and that value is right: what a solution returning that value earns. An
object with a forged `__eq__` does not survive JSON; exiting early reports no values.
"""

import asyncio
import json
import re
import secrets

from instar import Action, Env, Result, Task
from instar.tasks.sandbox import ExecResult, run_code

# main.py in the sandbox: import the solution, evaluate each test's call, one line per value.
# Resource errors are re-raised: the sandbox reports them as violations.
HARNESS = """\
import json, sys
nonce = sys.stdin.readline().strip()
calls = json.load(open("calls.json"))
try:
    import solution
except BaseException:
    print("the code does not run:", file=sys.stderr)
    raise
for i, call in enumerate(calls):
    try:
        value = json.dumps(eval(call, dict(vars(solution))))
    except (MemoryError, OSError):
        raise
    except BaseException as e:
        print(f"{call}  ->  {type(e).__name__}: {e}"[:200], file=sys.stderr, flush=True)
    else:
        print(nonce, i, value, flush=True)
"""

_FENCE = re.compile(r"```(?:python|py)?\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The first fenced code block of a reply, or the whole reply."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


def run_tests(code: str, tests: list[dict], **limits) -> tuple[int, list[str], ExecResult]:
    """Run `tests` (e.g. `{"call": "f(2)", "expected": 9}`) against `code` in the sandbox:
    how many passed, a line per test that returned a wrong value, and the run. `limits` go
    to `run_code`. Only the calls enter the sandbox; the values come back as JSON and are
    compared here."""
    nonce = secrets.token_hex(8)  # keeps the code's own prints apart; not a secret
    run = run_code(HARNESS, stdin=nonce + "\n", **limits, files={
        "solution.py": code, "calls.json": json.dumps([t["call"] for t in tests])})
    values: dict[str, set[str]] = {}  # test index -> the values reported for it
    for line in run.stdout.splitlines():
        tag, _, rest = line.partition(" ")
        if tag == nonce:
            index, _, value = rest.partition(" ")
            values.setdefault(index, set()).add(value)  # a set: forked copies repeat lines
    passed, wrong = 0, []
    for i, test in enumerate(tests):
        reported = values.get(str(i), set())
        if len(reported) > 1:  # one value per test: several would let guesses pass
            wrong.append(f"{test['call']} reported {len(reported)} different values")
            continue
        try:
            value = json.loads(reported.pop())
        except (KeyError, ValueError, RecursionError):  # no value (it raised), or not JSON
            continue
        if value == test["expected"]:
            passed += 1
        else:
            wrong.append(f"{test['call']} returned {value!r}, expected {test['expected']!r}"[:200])
    return passed, wrong, run


def feedback(passed: int, total: int, wrong: list[str], run: ExecResult) -> str:
    """What the model reads after a failed attempt."""
    text = f"{passed} of {total} tests passed."
    if run.violation:
        text += f" The run was stopped by the {run.violation} limit."
    errors = "\n".join([*wrong[:3], run.stderr.strip()[-300:]]).strip()
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
        passed, wrong, run = await asyncio.to_thread(run_tests, extract_code(action.text),
                                                     self.tests, **self.limits)
        fraction = passed / len(self.tests)
        reward, self.last = fraction - self.last, fraction
        info = {"passed": passed, "tests": len(self.tests), "attempts": self.attempts,
                "exit_code": run.returncode, "violation": run.violation or "",
                "exec_s": run.seconds}
        if passed == len(self.tests) or self.attempts >= self.max_turns:
            return Result(reward=reward, info=info)
        return Result(reward=reward, observation=feedback(passed, len(self.tests), wrong, run),
                      terminated=False, info=info)


AgentRunner = CodeExec
