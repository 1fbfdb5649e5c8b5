import json

import pytest

from instar.sample import Sample, read_jsonl, write_jsonl


def make(**over):
    fields = dict(rollout_id="r0", group_id="g0", segment=0, tokens=[5, 6, 7, 8],
                  loss_mask=[False, True, True, False], logprobs=[None, -0.5, -1.5, None],
                  versions=[None, 3, 4, None], reward=1.0, finish_reason="stop",
                  sampling={"temperature": 1.0}, info={"exact": 1.0})
    return Sample(**{**fields, **over})


def test_jsonl_round_trip(tmp_path):
    a, b = make(), make(rollout_id="r1", reward=0.25, routed_experts=[[[0, 1]]] * 4)
    write_jsonl(tmp_path / "s.jsonl", [a, b])
    assert read_jsonl(tmp_path / "s.jsonl") == [a, b]


@pytest.mark.parametrize("over, message", [
    (dict(loss_mask=[False, True, True]), "loss_mask has 3 entries, tokens has 4"),
    (dict(logprobs=[None, -0.5, -1.5]), "logprobs has 3 entries"),
    (dict(versions=[None, 3, 4, None, None]), "versions has 5 entries"),
    (dict(logprobs=[None, -0.5, None, None]), "generated token 2 needs a log-prob"),
    (dict(versions=[None, None, 4, None]), "generated token 1 needs a log-prob <= 0 and a version"),
    (dict(logprobs=[None, 0.5, -1.5, None]), "generated token 1"),
    (dict(logprobs=[-0.1, -0.5, -1.5, None]), "token 0 is not generated"),
    (dict(versions=[None, 3, 4, 4]), "token 3 is not generated"),
    (dict(loss_mask=[False] * 4, logprobs=[None] * 4, versions=[None] * 4), "no generated tokens"),
    (dict(routed_experts=[[[0, 1]]]), "routed_experts has 1 entries"),
])
def test_rejects_misaligned_records(over, message):
    with pytest.raises(ValueError, match=message):
        make(**over)


def test_from_json_validates():
    line = make().to_json().replace('"loss_mask":[false,true,true,false]',
                                    '"loss_mask":[false,true,true]')
    with pytest.raises(ValueError, match="loss_mask"):
        Sample.from_json(line)


def test_jsonl_holds_the_decoded_prompt_and_completion_beside_the_tokens(tmp_path, tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nReverse: abc<|im_end|>\n<|im_start|>assistant\n")
    reply = tokenizer.encode("cba<|im_end|>")
    s = make(tokens=prompt + reply, loss_mask=[False] * len(prompt) + [True] * len(reply),
             logprobs=[None] * len(prompt) + [-0.5] * len(reply),
             versions=[None] * len(prompt) + [0] * len(reply))
    write_jsonl(tmp_path / "s.jsonl", [s], tokenizer)
    line = json.loads((tmp_path / "s.jsonl").read_text())
    assert line["prompt_text"] == "<|im_start|>user\nReverse: abc<|im_end|>\n<|im_start|>assistant\n"
    assert line["completion_text"] == "cba<|im_end|>"
    assert line["tokens"] == s.tokens
    assert read_jsonl(tmp_path / "s.jsonl") == [s]  # (the text is for people: not read back)
