"""Built-in tiny models: Qwen3-shaped checkpoints made locally, deterministically from a seed.

    instar make-model --out DIR [--kind dense|moe|vl] [--size tiny|small] [--seed N]

`vl` is a vision-language model (Qwen2-VL: a one-block vision tower, tiny only) whose
template renders image parts as `<|vision_start|><|image_pad|><|vision_end|>`.

The folder is an ordinary Hugging Face checkpoint (config.json, model.safetensors,
tokenizer.json, chat template) that transformers and vLLM load. All sizes share one
byte-level BPE tokenizer trained here, so a small teacher and a tiny student can be paired.
`builtin_model()` builds into a cache folder once and reuses it afterwards.
"""

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

# Bump when the builder's output changes, so cached folders are rebuilt.
BUILD_VERSION = 2

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_MARKS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VISION_MARKS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB_SIZE = 512

# ChatML with tools, in the Qwen style. Tool calls render as <tool_call>{json}</tool_call>;
# tool results render as a `tool` turn wrapped in <tool_response>.
CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set sys = messages[0].role == 'system' -%}
{%- if tools or sys -%}
<|im_start|>system
{% if sys %}{{ text(messages[0].content) }}{% endif %}
{%- if tools %}{% if sys %}

{% endif %}# Tools
Call a tool by replying with <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.
<tools>
{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}
{% endfor %}</tools>
{%- endif %}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if not (loop.first and sys) -%}
{%- if m.role == 'assistant' -%}
<|im_start|>assistant
{{ text(m.content) }}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
<tool_call>{"name": {{ f.name | tojson }}, "arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}</tool_call>
{%- endfor -%}
<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>tool
<tool_response>{{ text(m.content) }}</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ text(m.content) }}<|im_end|>
{% endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""
# The vision-language model's template: the same, with image parts rendered as placeholders.
VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ part.text }}{%- endif -%}",
    "{{ part.text }}{%- elif part.type in ('image', 'image_url') -%}"
    "<|vision_start|><|image_pad|><|vision_end|>{%- endif -%}")
assert VL_CHAT_TEMPLATE != CHAT_TEMPLATE

SHAPES = {
    # dense: Qwen3; moe: Qwen3-MoE. tiny is for tests (well under 1M params),
    # small for benchmarks (about 20-30M).
    ("dense", "tiny"): dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, intermediate_size=256),
    ("dense", "small"): dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=64, intermediate_size=2048),
    ("moe", "tiny"): dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=128),
    ("moe", "small"): dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=64, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=512),
    # vl: Qwen2-VL; text as dense/tiny (M-RoPE sections sum to head_dim / 2). Images are
    # resized to at most 112x112 pixels: at most 16 image tokens each.
    ("vl", "tiny"): dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [4, 6, 6]},
                         vision=dict(depth=1, embed_dim=32, num_heads=2, mlp_ratio=2),
                         pixels=(28 * 28, 112 * 112)),
}


def _corpus() -> list[str]:
    """Deterministic text the tokenizer learns its merges from: chat markup, tool JSON, words."""
    rng = random.Random(0)
    words = ("the a of to and is in it you that for on with as what how many tool call "
             "result answer question add sum number letters copy reverse repeat count name "
             "arguments function calculator lookup error true false null user assistant "
             "system reply please think step value").split()
    lines = []
    for _ in range(3000):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        number = str(rng.randint(0, 9999))
        call = json.dumps({"name": rng.choice(words), "arguments": {rng.choice(words): number}})
        lines.append(f"<|im_start|>user\n{sentence.capitalize()}? {number}<|im_end|>\n"
                     f"<|im_start|>assistant\n<tool_call>{call}</tool_call><|im_end|>\n")
    return lines


def build_tokenizer():
    """A byte-level BPE tokenizer (shared by every built-in model) with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_MARKS), special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:])
    fast.add_tokens(TOOL_MARKS)  # single tokens, but not special: they stay in decoded text
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(out: str | Path, kind: str = "dense", size: str = "tiny", seed: int = 0) -> Path:
    """Write a freshly initialised checkpoint to `out` (atomically: a temp folder, then rename)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config, Qwen3MoeConfig

    if (kind, size) not in SHAPES:
        raise ValueError(f"unknown model kind/size {kind}/{size}; choose kind in dense|moe|vl, "
                         "size in tiny|small (vl: tiny only)")
    out = Path(out)
    tok = saved = build_tokenizer()
    if kind == "vl":  # the processor (tokenizer, image processor) is saved with the model
        model, saved = _vision_language(tok, dict(SHAPES[kind, size]), seed)
    else:
        cls = Qwen3Config if kind == "dense" else Qwen3MoeConfig
        config = cls(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     bos_token_id=None, **SHAPES[kind, size])
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    model.save_pretrained(tmp)
    saved.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _vision_language(tok, shape: dict, seed: int):
    """A Qwen2-VL model and its processor; `tok` (the shared tokenizer) gains the vision
    tokens (ids after the text ones, so text tokenises as for the other models)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok.add_special_tokens({"additional_special_tokens": SPECIAL[1:] + VISION_MARKS})
    tok.chat_template = VL_CHAT_TEMPLATE
    vision, (min_pixels, max_pixels) = shape.pop("vision"), shape.pop("pixels")
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id",
                    "video_token_id"), tok.convert_tokens_to_ids(VISION_MARKS)))
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), max_position_embeddings=4096,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None, **shape),
        vision_config=dict(hidden_size=shape["hidden_size"], **vision),
        tie_word_embeddings=True, **ids)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    images = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    return model, Qwen2VLProcessor(image_processor=images, tokenizer=tok,
                                   video_processor=Qwen2VLVideoProcessor(),
                                   chat_template=VL_CHAT_TEMPLATE)


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "instar"


def write_rows(path: Path, rows: list[dict]) -> None:
    """`rows` as JSONL at `path`, atomically: a reader finds the whole file or none."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def builtin_model(kind: str = "dense", size: str = "tiny", seed: int = 0) -> Path:
    """Path of the built-in model, built into the cache on first use."""
    path = cache_root() / "models" / f"{kind}-{size}-seed{seed}-v{BUILD_VERSION}"
    if not (path / "config.json").exists():
        build_model(path, kind, size, seed)
    return path
