"""A bad input (config, agent, data, model) stops a command before anything starts: one line
`instar CMD: error: ...` on stderr, exit code 2, no traceback (`--debug` shows it), and no run
directory left behind. Agent files are checked without running them."""

import json

import pytest
from PIL import Image

from instar.agents.images import data_url
from instar.agents.loading import check_agent_file, load_agent
from instar.cli import main

SIDE_EFFECT = "open({marker!r}, 'w').write('ran')\n"


def agent(tmp_path, body: str) -> tuple[str, object]:
    """An agent file that, if it is ever run, writes a marker file."""
    marker = tmp_path / "ran"
    path = tmp_path / "agent.py"
    path.write_text(SIDE_EFFECT.format(marker=str(marker)) + body)
    return str(path), marker


@pytest.mark.parametrize("body, error", [
    ("class Mine:\n    pass\n", "defines no AgentRunner: name the agent class"),
    ("from instar import Env\nclass E(Env):\n    def reset(self, task):\n        return ''\n"
     "    async def step(self, action):\n        pass\nAgentRunner = E\n",
     r"agent.py:4: E.reset must be `async def reset\(...\)`"),
    ("from instar import ChatAgent\nclass Base(ChatAgent):\n    def run(self, ctx):\n        pass\n"
     "class C(Base):\n    pass\nAgentRunner = C\n", r"agent.py:4: Base.run must be `async def"),
    ("def broken(:\n", "agent.py:2: invalid syntax"),
])
def test_an_agent_file_is_checked_without_running_it(tmp_path, body, error):
    path, marker = agent(tmp_path, body)
    with pytest.raises((ValueError, TypeError), match=error):
        load_agent(path)
    assert not marker.exists(), "the agent file ran before it was checked"


def test_a_sync_helper_named_step_on_a_chat_agent_is_fine(tmp_path):
    path, _ = agent(tmp_path, "from instar import ChatAgent\nclass C(ChatAgent):\n"
                              "    def step(self):\n        pass\n    async def run(self, ctx):\n"
                              "        pass\nAgentRunner = C\n")
    check_agent_file(path)  # `step` is an Env hook, not a ChatAgent's


def test_an_agent_that_fails_to_import_is_one_error(tmp_path):
    path, marker = agent(tmp_path, "import no_such_module_here\nAgentRunner = None\n")
    with pytest.raises(ValueError, match="importing it raised ModuleNotFoundError"):
        load_agent(path)


def test_bad_inputs_exit_2_in_one_line_and_leave_no_run_directory(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("instar.cli.DEBUG", False)  # (restored after main's --debug below)
    path, _ = agent(tmp_path, "class Mine:\n    pass\n")
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": "b",}\n')
    seen = tmp_path / "seen.jsonl"  # (an image the built-in text model cannot read)
    seen.write_text(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "image", "image": data_url(Image.new("RGB", (8, 8)))},
                                     {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": "black"}]}) + "\n")
    cases = {
        ("rollout", "--agent", path): f"instar rollout: error: agent file {path} defines no",
        ("rl", "--data.train", str(data)): f"instar rl: error: {data}:2: not JSON",
        ("rl", "--train.warmup-sft-data", str(data)):  # (checked before anything starts)
            f'instar rl: error: {data}:1: expected an object with a non-empty "messages" list',
        ("rl", "--train.warmup-sft-data", str(seen)):
            f"instar rl: error: {seen}: row 1: it has images, but ",
        ("eval", "--config", "missing.yaml"): "instar eval: error: cannot read the recipe",
        ("rl", "--model.path", str(tmp_path / "no" / "such")): "instar rl: error: ",
        ("rl", "--lora.rank", "8", "--lora.targets", r".*(lm_head|q_proj)"):
            "instar rl: error: LoRA targets '.*(lm_head|q_proj)' match lm_head",
        ("eval", "--lora.path", str(tmp_path)): f"instar eval: error: --lora.path {tmp_path}: "
                                                "not a PEFT adapter folder",
    }
    for args, error in cases.items():
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--logging.root", str(tmp_path / "runs")])
        stderr = capsys.readouterr().err
        assert exit_.value.code == 2 and stderr.count("\n") == 1, (args, stderr)
        assert stderr.startswith(error), (args, stderr)
        assert not (tmp_path / "runs").exists(), args
    with pytest.raises(ValueError, match="defines no AgentRunner"):  # the traceback
        main(["--debug", "rollout", "--agent", path])


@pytest.mark.stack  # (imports vLLM's parsers: some seconds)
@pytest.mark.parametrize("command", ["rollout", "serve"])
def test_an_unknown_parser_is_refused_before_anything_starts(command, tmp_path, monkeypatch,
                                                             capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([command, "--model.tool-parser", "nope", "--logging.root", str(tmp_path / "runs")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(  # (after torch's import notes)
        f"instar {command}: error: --model.tool-parser 'nope' is not a vLLM parser; known: ")
    assert not (tmp_path / "runs").exists()
