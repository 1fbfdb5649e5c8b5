"""The preflight gate on the real stack: fresh engine samples rescored by the trainer pass;
a wrongly scaled temperature, a prompt rendered with another template, or other weights
stop the run with a diagnosis that names the cause. Plus pass@k against hand counts."""

from dataclasses import replace

import pytest

from instar.agents.loading import load_agent, load_tasks
from instar.config import Config
from instar.evaluate import pass_at_k
from instar.preflight import preflight
from instar.rollout.runner import Rollouts
from instar.tasks.builtin import task_agent
from instar.tasks.reverse_data import reverse_data
from instar.tasks.tiny_model import builtin_model
from instar.train.trainer import Trainer


def test_pass_at_k_matches_hand_counts():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)


@pytest.fixture(scope="module")
def samples(engine, tokenizer):
    tasks = load_tasks(reverse_data()[0])[:6]
    rollouts = Rollouts(load_agent(task_agent("reverse")), {}, [engine], tokenizer,
                        model_name="tiny", max_model_len=512, limits={})
    try:
        batch = rollouts.run(tasks, 1, {"temperature": 1.0, "max_tokens": 12}, "pf")
    finally:
        rollouts.close()
    assert len(batch.samples) == 6
    return batch.samples


@pytest.mark.stack
def test_preflight_passes_and_diagnoses(engine, tiny_model, tokenizer, samples):
    trainer = Trainer(Config().validate(), str(tiny_model))
    try:
        assert preflight(samples, trainer, engine, 1.0, 1e-3) < 1e-4
        with pytest.raises(RuntimeError, match="fit temperature 1.0, not 0.5"):
            preflight(samples, trainer, engine, 0.5, 1e-3)
        system = tokenizer.apply_chat_template(  # the same prompt under a system message
            [{"role": "system", "content": "Be brief."}], tokenize=False)
        extra = tokenizer.encode(system, add_special_tokens=False)
        rerendered = [replace(s, tokens=extra + s.tokens, loss_mask=[False] * len(extra) + s.loss_mask,
                              logprobs=[None] * len(extra) + s.logprobs,
                              versions=[None] * len(extra) + s.versions) for s in samples]
        with pytest.raises(RuntimeError, match="another context than the trainer sees"):
            preflight(rerendered, trainer, engine, 1.0, 1e-3)
        with pytest.raises(ValueError, match="needs a log-prob"):  # a bad mask: refused
            replace(samples[0], loss_mask=[True] * len(samples[0].tokens))  # at construction
    finally:
        trainer.shutdown()
    other = Trainer(Config().validate(), str(builtin_model("dense", "tiny", 1)))  # other weights
    try:
        with pytest.raises(RuntimeError, match="hold different weights"):
            preflight(samples, other, engine, 1.0, 1e-3)
    finally:
        other.shutdown()
