"""Shared fixtures: the built-in tiny model, one Ray session and one engine for all tests."""

import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model():
    from instar.tasks.tiny_model import builtin_model

    return builtin_model("dense", "tiny", 0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def serve_model(path):
    """One CPU engine on `path` for the test session; shut down at the end."""
    import ray

    from instar.rollout.engine import launch

    (actor,) = launch(str(path), device="cpu", dtype="float32", max_model_len=512,
                      kv_cache_gb=1, threads=1, seed=0)
    yield actor
    ray.get(actor.shutdown.remote())


@pytest.fixture(scope="session")
def engine(ray_session, tiny_model):
    yield from serve_model(tiny_model)


sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from calculator_tool import CALCULATOR  # noqa: E402

TOOL_CONVERSATION = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                      "arguments": {"expression": "2+3"}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "The answer is 5."},
]


@pytest.fixture(scope="session")
def tool_model(tiny_model, tmp_path_factory):
    """The tiny model taught (a few seconds of SFT) to call the calculator and then answer, so
    that real engine generations contain tool calls (examples/calculator_tool.py)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("tool_model")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids, mask = [], []
    for i, msg in enumerate(TOOL_CONVERSATION):
        text = tok.apply_chat_template(TOOL_CONVERSATION[:i + 1], tools=[CALCULATOR], tokenize=False)
        new = tok.encode(text, add_special_tokens=False)[len(ids):]
        ids += new
        # learn the assistant turns: everything after "<|im_start|>assistant\n" up to <|im_end|>
        head = len(tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
        mask += [msg["role"] == "assistant" and head <= j < len(new) - 1 for j in range(len(new))]
    x, m = torch.tensor([ids]), torch.tensor([mask], dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(250):
        logp = torch.log_softmax(model(x).logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
        loss = -(logp * m[:, 1:]).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    for f in tiny_model.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tool_engine(ray_session, tool_model):
    yield from serve_model(tool_model)
