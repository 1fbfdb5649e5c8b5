import hashlib
import json
import subprocess
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from instar.tasks.tiny_model import SHAPES, build_model


def digest(folder):
    return hashlib.sha256((folder / "model.safetensors").read_bytes()
                          + (folder / "tokenizer.json").read_bytes()).hexdigest()


def test_make_model_cli_is_deterministic_and_loads_in_transformers(tmp_path):
    for name in ("a", "b"):
        subprocess.run([sys.executable, "-m", "instar.cli", "make-model", "--out",
                        str(tmp_path / name), "--seed", "3"], check=True, timeout=120)
    build_model(tmp_path / "c", seed=4)
    assert digest(tmp_path / "a") == digest(tmp_path / "b") != digest(tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert model.config.model_type == "qwen3"
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    ids = torch.tensor([[1, 2, 3]])
    assert model(ids).logits.shape == (1, 3, model.config.vocab_size)


def test_moe_and_small_shapes(tmp_path):
    build_model(tmp_path / "moe", kind="moe", size="tiny")
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    assert moe.config.model_type == "qwen3_moe" and moe.config.num_experts == 4
    assert sum(p.numel() for p in moe.parameters()) < 1_000_000
    for kind in ("dense", "moe"):  # small: about 20-30M parameters, checked from the config
        cfg = AutoConfig.for_model("qwen3" if kind == "dense" else "qwen3_moe", vocab_size=512,
                                   tie_word_embeddings=True, **SHAPES[kind, "small"])
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
        assert 20e6 <= n <= 30e6, (kind, n)


def test_chat_template_renders_roles_tools_and_tool_calls(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                               "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.")
    assert json.dumps(tools[0]["function"]) in text
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>5</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n5<|im_end|>\n")
    # OpenAI-style string arguments render verbatim
    messages[2]["tool_calls"][0]["function"]["arguments"] = '{"a": 2}'
    assert '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>' in \
        tok.apply_chat_template(messages, tools=tools, tokenize=False)
    # markup tokens are single tokens, so the engine can emit and stop on them
    for mark in ("<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(tok.encode(mark, add_special_tokens=False)) == 1
    assert tok.eos_token == "<|im_end|>"
