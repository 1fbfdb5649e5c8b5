"""`instar view`: run directories of real Samples (written by the dumps' own writer, decoded
with the built-in tokenizer) become one self-contained HTML page; headless Chromium opens it
and the episodes, tokens, colours and filters render with no script error."""

import json
import re
import traceback
from pathlib import Path

import pytest

from instar.agents.chat import continuation_ids, prompt_ids
from instar.cli import main
from instar.config import Config
from instar.errors import EpisodeError
from instar.sample import Sample, read_jsonl, write_jsonl
from instar.tasks.tools import CALCULATOR
from instar.view import page, pieces

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--disable-quic"]


def generated(tokenizer, text: str, version: int, lp: float = -0.5):
    """A model turn: its ids, behaviour log-probs and versions."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids, [lp - 0.1 * (i % 7) for i in range(len(ids))], [version] * len(ids)


def sample(rollout_id, parts, reward, finish, segment=0, **info):
    """A Sample from (ids, log-probs or None, versions or None) parts in order."""
    tokens, lps, vs = [], [], []
    for ids, lp, v in parts:
        tokens += ids
        lps += lp or [None] * len(ids)
        vs += v or [None] * len(ids)
    return Sample(rollout_id=rollout_id, group_id=rollout_id.rsplit("-", 1)[0], segment=segment,
                  tokens=tokens, loss_mask=[lp is not None for lp in lps], logprobs=lps,
                  versions=vs, reward=reward, finish_reason=finish, task_id="calc-1",
                  sampling={"temperature": 1.0}, info=info)


def make_run(root: Path, tokenizer, agent: str, steps=(1, 2)) -> Path:
    """A run directory as instar rl leaves it: config.yaml, rollouts.jsonl (with each line's
    step and trainer log-probs), failed_rollouts.jsonl."""
    root.mkdir(parents=True)
    cfg = Config()
    cfg.agent.file = agent
    (root / "config.yaml").write_text(cfg.to_yaml())
    user = [{"role": "user", "content": "What is 2+3? Naïve café ✓"}]
    call = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
            "<|im_end|>")
    for step in steps:
        v = step - 1
        turn1 = generated(tokenizer, call, v - 1 if step > 1 else v)  # (lag 1 from step 2 on)
        before = user + [{"role": "assistant", "content": call.removesuffix("<|im_end|>")}]
        after = before + [{"role": "tool", "content": "5"}]
        obs = continuation_ids(tokenizer, before, after, [CALCULATOR], True)
        tool_episode = sample(f"t{step}-calc-1-0", [
            (prompt_ids(tokenizer, user, [CALCULATOR]), None, None), turn1, (obs, None, None),
            generated(tokenizer, "The answer is 5.<|im_end|>", v)], 1.0, "stop",
            turns=2, turn_rewards=[0.0, 1.0], tool_call_errors=0)
        rewritten = [sample(f"t{step}-calc-1-1", [
            (prompt_ids(tokenizer, user, None), None, None),
            generated(tokenizer, "Let me think about it.<|im_end|>", v)], 0.25, "length",
            segment=k, turns=2, sealed_because=why)
            for k, why in enumerate(["history_rewritten", ""])]
        samples = [tool_episode, *rewritten]
        trainer = [[None if lp is None else lp + 3e-7 for lp in s.logprobs] for s in samples]
        write_jsonl(root / "rollouts.jsonl", samples, tokenizer,
                    [{"step": step, "trainer_logprobs": t} for t in trainer])
    try:
        raise EpisodeError("agent_error", "the calculator raised ZeroDivisionError")
    except EpisodeError as e:
        err = {"rollout_id": f"t{steps[-1]}-calc-1-2", "reason": e.reason, "attempt": 0,
               "traceback": "".join(traceback.format_exception(e))}
    (root / "failed_rollouts.jsonl").write_text(json.dumps({"step": steps[-1], **err}) + "\n")
    return root


@pytest.fixture
def runs(tmp_path, tokenizer):
    return [make_run(tmp_path / "env", tokenizer, "examples/calculator_env.py"),
            make_run(tmp_path / "chat", tokenizer, "examples/calculator_openai.py", steps=(3,))]


def test_the_dump_notes_are_beside_the_sample_and_left_by_read_jsonl(runs):
    lines = [json.loads(x) for x in (runs[0] / "rollouts.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 1, 1, 2, 2, 2]
    samples = read_jsonl(runs[0] / "rollouts.jsonl")
    assert [s.rollout_id for s in samples] == [x["rollout_id"] for x in lines]
    assert all(len(x["trainer_logprobs"]) == len(s.tokens) for x, s in zip(lines, samples))


def test_pieces_spell_the_decoded_text(tokenizer):
    text = "Naïve café ✓ 日本語 <|im_end|>\n  two  spaces\tand a tab"
    ids = tokenizer.encode(text, add_special_tokens=False)
    parts = pieces(tokenizer, ids)
    assert len(parts) == len(ids) and "".join(parts) == tokenizer.decode(ids)
    assert "<|im_end|>" in parts  # a special token is a piece of its own


def test_the_page_holds_each_episode_with_its_segments_tokens_and_failure(runs):
    html, data = page(runs)
    assert [r["path"] for r in data["runs"]] == [str(p) for p in runs]
    eps = {(e["run"], e["id"]): e for e in data["episodes"]}
    assert len(eps) == len(data["episodes"]) == 2 * 2 + 1 + 2 + 1  # episodes, failures
    tool = eps[0, "t2-calc-1-0"]
    assert (tool["step"], tool["policy"], tool["reward"], tool["finish"]) == (2, 1, 1.0, "stop")
    assert tool["agent"] == "examples/calculator_env.py"
    (seg,) = tool["segments"]
    said = "".join(t for t, lp in zip(seg["text"], seg["lp"]) if lp is not None)
    assert said.count("<tool_call>") == 1 and "<tool_response>" in "".join(seg["text"])
    assert len(seg["text"]) == len(seg["ids"]) == len(seg["lp"]) == len(seg["v"]) == len(seg["tl"])
    lags = {1 - v for v, lp in zip(seg["v"], seg["lp"]) if lp is not None}
    assert lags == {0, 1}
    split = eps[0, "t1-calc-1-1"]
    assert [(s["segment"], s["sealed"]) for s in split["segments"]] == [(0, "history_rewritten"),
                                                                      (1, "")]
    failed = eps[1, "t3-calc-1-2"]
    assert failed["failed"] == "agent_error" and failed["step"] == 3
    assert "ZeroDivisionError" in failed["traceback"] and "Traceback" in failed["traceback"]
    # one self-contained file: the data inline, nothing fetched
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "__DATA__" not in html and html.count("<script") == 2
    blob = re.search(r'<script id="data" type="application/json">(.*?)</script>', html, re.S)
    assert json.loads(blob.group(1)) == data


def test_instar_rollout_output_has_no_step_and_lags_count_from_its_newest_version(tmp_path,
                                                                                  tokenizer):
    run = tmp_path / "rollout"
    run.mkdir()
    (run / "config.yaml").write_text(Config().to_yaml())
    user = [{"role": "user", "content": "Reverse: abc"}]
    write_jsonl(run / "rollouts.jsonl", [  # as instar rollout writes it: no notes but the text
        sample(f"rollout-rev-{k}", [(prompt_ids(tokenizer, user, None), None, None),
                                    generated(tokenizer, "cba<|im_end|>", k)], 1.0, "stop")
        for k in range(3)], tokenizer)
    (run / "failed_rollouts.jsonl").write_text("")
    _, data = page([run])
    assert [(e["step"], e["policy"]) for e in data["episodes"]] == [(None, 2)] * 3
    assert data["runs"][0]["model"] == "built-in dense-tiny"
    assert {e["agent"] for e in data["episodes"]} == {"built-in"}


def test_instar_view_writes_the_page_and_refuses_bad_input_in_one_line(runs, tmp_path, capsys):
    main(["view", str(runs[0])])
    assert capsys.readouterr().out.strip() == str(runs[0] / "view.html")
    assert "t2-calc-1-0" in (runs[0] / "view.html").read_text()
    main(["view", str(runs[1] / "rollouts.jsonl"), "--out", str(tmp_path / "one.html")])
    assert (tmp_path / "one.html").is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"rollout_id": "r"}\n')
    listed = tmp_path / "listed.jsonl"
    listed.write_text("[1, 2]\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "rollouts.jsonl").write_text((runs[0] / "rollouts.jsonl").read_text())
    (garbled / "config.yaml").write_text("model: [unclosed")
    for args, error in [([str(tmp_path / "nope")], "no such run directory or samples file"),
                        ([str(empty)], "not a run directory: it has none of rollouts.jsonl"),
                        ([str(bad)], f"{bad}:1: not a sample"),
                        ([str(listed)], f"{listed}:1: not a sample"),
                        ([str(garbled)], f"{garbled / 'config.yaml'}: not YAML"),
                        ([str(runs[0]), "--tokenizer", str(empty)], "cannot load the tokenizer")]:
        with pytest.raises(SystemExit) as exit_:
            main(["view", *args])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith("instar view: error: ") and error in err, err


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no browser at {CHROMIUM}: install "
                    "Debian's chromium package (scripts/setup_cpu.sh does, where it runs as root)")
def test_the_page_renders_in_headless_chromium(runs, tmp_path):
    from playwright.sync_api import sync_playwright

    html = tmp_path / "view.html"
    html.write_text(page(runs)[0])
    _, data = page(runs)
    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        pg = browser.new_page(viewport={"width": 1280, "height": 900})
        pg.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
        pg.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
        requests = []
        pg.on("request", lambda r: requests.append(r.url))
        pg.goto(html.as_uri())
        n = len(data["episodes"])
        assert pg.text_content("#count") == f"{n} of {n} episodes"
        assert pg.locator("details.ep").count() == n
        first = data["episodes"][0]  # open, its tokens drawn: one span per token
        tokens = pg.locator("details.ep").first.locator(".tok")
        assert tokens.count() == sum(len(s["ids"]) for s in first["segments"])
        assert "".join(tokens.all_text_contents()) == "".join(first["segments"][0]["text"])
        gen = pg.locator("details.ep").first.locator(".part.gen .tok.gen")
        assert gen.count() == sum(lp is not None for lp in first["segments"][0]["lp"])
        assert pg.locator("details.ep").first.locator(".part.ctx .tok.gen").count() == 0
        assert pg.locator("details.ep").first.locator(".tok.call").count() > 0
        assert pg.locator("details.ep").first.locator(".tok.result").count() > 0
        between = pg.locator("details.ep").first.locator(".part.ctx")
        assert "not trained" in between.first.text_content()
        # colours: each generated token has a background under log-prob; lag marks only lag > 0
        assert all(gen.evaluate_all("ts => ts.map(t => t.style.background !== '')"))
        pg.select_option("#f-colour", "lag")
        coloured = "ts => ts.filter(t => t.style.background).length"
        lagged = pg.locator(".tok.gen").evaluate_all(coloured)
        assert 0 < lagged < pg.locator(".tok.gen").count()
        pg.select_option("#f-colour", "diff")
        assert pg.locator(".tok.gen.norec").count() == 0  # (each line has trainer log-probs)
        # filters: step, outcome, agent, reward
        pg.select_option("#f-step", "2")
        assert pg.locator("details.ep").count() == 3  # two episodes, a failure
        pg.select_option("#f-step", "")
        pg.select_option("#f-fail", "failed")
        assert pg.locator("details.ep.failed").count() == pg.locator("details.ep").count() == 2
        pg.locator("details.ep.failed summary").first.click()
        assert "ZeroDivisionError" in pg.locator("details.ep.failed pre.tb").first.text_content()
        pg.select_option("#f-fail", "")
        pg.select_option("#f-agent", "examples/calculator_openai.py")
        assert pg.locator("details.ep").count() == 3
        pg.select_option("#f-agent", "")
        pg.fill("#f-rmin", "0.5")
        assert pg.locator("details.ep").count() == 3  # the tool episodes, reward 1
        pg.fill("#f-rmin", "")
        pg.select_option("#f-colour", "logprob")
        pg.screenshot(path=str(tmp_path / "view.png"), full_page=True)
        browser.close()
    assert not errors, errors
    assert all(u.startswith("file:") for u in requests), requests
    assert (tmp_path / "view.png").stat().st_size > 10_000
