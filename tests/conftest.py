"""Shared fixtures: the built-in tiny model, one Ray session and one engine for all tests."""

from pathlib import Path

import pytest

from instar.tasks.tools import CALCULATOR


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


TOOL_CONVERSATION = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                      "arguments": {"expression": "2+3"}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "The answer is 5."},
]


def teach(base: Path, out: Path, conversations: list[list[dict]], tools: list[dict] | None,
          steps: int = 250) -> Path:
    """`base` after a few seconds of SFT on the assistant turns of `conversations` (a model
    that reliably says what it was taught), written to `out` with the tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    batch = []
    for conversation in conversations:
        ids, mask = [], []
        for i, msg in enumerate(conversation):
            text = tok.apply_chat_template(conversation[:i + 1], tools=tools, tokenize=False)
            new = tok.encode(text, add_special_tokens=False)[len(ids):]
            ids += new
            # learn the assistant turns: everything after "<|im_start|>assistant\n" up to <|im_end|>
            head = len(tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
            mask += [msg["role"] == "assistant" and head <= j < len(new) - 1
                     for j in range(len(new))]
        batch.append((torch.tensor([ids]), torch.tensor([mask], dtype=torch.float32)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = 0
        for x, m in batch:
            logp = torch.log_softmax(model(x).logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
            loss = loss - (logp * m[:, 1:]).sum() / m.sum()
        loss = loss / len(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tool_model(tiny_model, tmp_path_factory):
    """The tiny model taught (a few seconds of SFT) to call the calculator and then answer, so
    that real engine generations contain tool calls (instar/tasks/tools.py)."""
    return teach(tiny_model, tmp_path_factory.mktemp("tool_model"), [TOOL_CONVERSATION],
                 [CALCULATOR])


@pytest.fixture(scope="session")
def tool_engine(ray_session, tool_model):
    yield from serve_model(tool_model)
