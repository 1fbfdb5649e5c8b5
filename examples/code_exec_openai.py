"""The code-execution task (instar/tasks/code_exec.py) as a ChatAgent through the OpenAI
SDK: the model writes a function, the sandbox runs the task's tests on it, and a failed
attempt's test report goes back to the model for one more try.

    python -m instar.tasks.code_exec_data        # prints the train and eval paths
    instar rollout --agent examples/code_exec_openai.py --data.train EVAL.jsonl
"""

import asyncio

import openai

from instar import ChatAgent, ChatContext, Result
from instar.tasks.code_exec import extract_code, feedback, run_tests


class CodeExecOpenAI(ChatAgent):
    max_turns = 2
    limits = dict(cpu_s=2.0, wall_s=10.0, memory_mb=256)

    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        tests = ctx.task.data["tests"]
        messages = [{"role": "user", "content": ctx.task.prompt}]
        for attempt in range(1, self.max_turns + 1):
            reply = (await client.chat.completions.create(
                model=ctx.model, messages=messages)).choices[0].message.content or ""
            passed, wrong, run = await asyncio.to_thread(run_tests, extract_code(reply), tests,
                                                         **self.limits)  # off the event loop
            if passed == len(tests) or attempt == self.max_turns:
                break
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": feedback(passed, len(tests), wrong, run)}]
        return Result(reward=passed / len(tests), info={
            "passed": passed, "tests": len(tests), "attempts": attempt,
            "exit_code": run.returncode, "violation": run.violation or ""})


AgentRunner = CodeExecOpenAI
