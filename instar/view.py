"""`instar view`: one self-contained HTML page of a run's episodes, token by token.

    instar view runs/20261206-101500                 # writes runs/20261206-101500/view.html
    instar view runs/rollout-20261206-1015 runs/20261206-101500 --out both.html
    instar view runs/eval-20261206-1015/eval_samples.jsonl   # writes eval_samples.html beside it

A run directory (instar rl, rollout, eval or serve) gives its samples files (rollouts.jsonl,
eval_samples.jsonl, sessions.jsonl; a multi-LoRA run's adapters/<name>/rollouts.jsonl too),
the failed_rollouts.jsonl beside each, and its config.yaml, which names the model whose
tokenizer decodes the tokens (only the tokenizer is loaded; --tokenizer overrides it).

    samples file ──(step, rollout_id)──> episode: its segments, each with why it was sealed,
                                           and per token: text, behaviour log-prob, version,
                                           trainer log-prob (instar rl's dump)
    failed_rollouts.jsonl ─────────────> failed episode: reason, attempt, traceback
                        both ──> JSON inside view.html (this folder): inline CSS and JS that
                                 draw the conversations, colours and filters; no network

The page splits each segment into its prompt, the model's turns (loss mask 1, coloured by
log-prob, version lag or engine-vs-trainer difference) and what came between them
(observations, tool results: loss mask 0, set apart).
"""

import json
from collections import defaultdict
from pathlib import Path

import yaml

from instar.sample import NOTES, Sample

SAMPLE_FILES = ("rollouts.jsonl", "eval_samples.jsonl", "sessions.jsonl")
TEMPLATE = Path(__file__).with_name("view.html")


def samples_files(path: Path) -> list[Path]:
    """The samples files `path` names: itself (a .jsonl file), or those of a run directory."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"{path}: no such run directory or samples file")
    found = [f for d in (path, *sorted(path.glob("adapters/*"))) for f in
             (d / name for name in SAMPLE_FILES) if f.is_file()]
    if not found:
        raise ValueError(f"{path}: not a run directory: it has none of {', '.join(SAMPLE_FILES)}")
    return found


def read_config(run: Path) -> dict:
    """The run's config.yaml as written (no defaults filled in, nothing validated); {} if none."""
    path = run / "config.yaml"
    try:
        config = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML ({type(e).__name__})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a run's config (a mapping of sections)")
    return config


def agent_of(config: dict, samples_file: Path) -> str:
    """Which agent the file's episodes ran: a multi-LoRA adapter's, or the run's --agent.file."""
    agent = config.get("agent", {}).get("file") or "built-in"
    if samples_file.parent.parent.name == "adapters":
        name = samples_file.parent.name
        adapters = config.get("lora", {}).get("adapters", [])
        adapter = next((a for a in adapters if a.get("name") == name), {})
        return f"{name}: {adapter.get('agent') or agent}"
    return agent


def load_tokenizer(config: dict, override: str):
    """The tokenizer of the run's model (--model.path, or the built-in model it names)."""
    from transformers import AutoTokenizer

    m = config.get("model", {})
    spec = override or m.get("path")
    try:
        if not spec:
            from instar.tasks.tiny_model import builtin_model

            spec = builtin_model(m.get("kind", "dense"), m.get("size", "tiny"), m.get("seed", 0))
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as e:
        first = (str(e).splitlines() or [""])[0]
        raise ValueError(f"cannot load the tokenizer of {spec} ({type(e).__name__}: {first}); "
                         "pass --tokenizer DIR") from e


def pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text; together they spell the decoded text. A character split over several
    tokens (bytes of UTF-8) is shown on the last of them."""
    out, done = [], 0
    for i in range(len(ids)):
        start = max(0, done - 4)  # a little context: decoders drop a leading space at the start
        before = tokenizer.decode(ids[start:done])
        text = tokenizer.decode(ids[start:i + 1])
        if text.endswith("\ufffd") and i + 1 < len(ids):
            out.append("")  # (an unfinished character: shown with the token that ends it)
            continue
        out.append(text[len(before):] if text.startswith(before) else tokenizer.decode(ids[i]))
        done = i + 1
    return out


def read_rows(path: Path) -> list[tuple[dict, Sample]]:
    """Each line of a samples file: its notes (step, trainer log-probs) and its Sample."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                d = json.loads(line)
                rows.append(({k: d[k] for k in NOTES if k in d},
                             Sample(**{k: v for k, v in d.items() if k not in NOTES})))
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{n}: not a sample ({e})") from e
    return rows


def episodes(rows: list[tuple[dict, Sample]], tokenizer, run: int, agent: str) -> list[dict]:
    """The file's samples as episodes: the segments of one rollout together, in order. The
    policy version a token's lag is counted from: step - 1 in instar rl (the weights the step
    trained), else the newest version in the file."""
    newest = max((v for _, s in rows for v in s.versions if v is not None), default=0)
    by_rollout = defaultdict(list)
    for notes, s in rows:
        by_rollout[notes.get("step"), s.rollout_id].append((notes, s))
    out = []
    for (step, rollout_id), segs in by_rollout.items():
        segs.sort(key=lambda ns: ns[1].segment)
        last = segs[-1][1]
        out.append({
            "run": run, "agent": agent, "step": step, "id": rollout_id, "group": last.group_id,
            "task": last.task_id, "reward": last.reward, "finish": last.finish_reason,
            "policy": newest if step is None else step - 1, "sampling": last.sampling,
            "info": {k: v for k, v in last.info.items() if k != "sealed_because"},
            "segments": [{"segment": s.segment, "sealed": s.info.get("sealed_because", ""),
                          "images": s.images or [], "ids": s.tokens,
                          "text": pieces(tokenizer, s.tokens), "lp": s.logprobs, "v": s.versions,
                          "tl": notes.get("trainer_logprobs")} for notes, s in segs]})
    return out


def failures(path: Path, run: int, agent: str) -> list[dict]:
    """The failed attempts recorded beside a samples file (failed_rollouts.jsonl), if any."""
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                e = json.loads(line)
                out.append({"run": run, "agent": agent, "step": e.get("step"),
                            "id": e["rollout_id"], "failed": e["reason"],
                            "attempt": e.get("attempt", 0), "traceback": e.get("traceback", "")})
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"{path}:{n}: not a failure record ({err!r})") from err
    return out


def page(paths: list[Path], tokenizer: str = "") -> tuple[str, dict]:
    """The HTML page of the runs or samples files at `paths`, and the data it shows."""
    runs, eps, specials = [], [], set()
    for i, path in enumerate(paths):
        files = samples_files(path)
        root = path if path.is_dir() else path.parent
        config = read_config(root)
        tok = load_tokenizer(config, tokenizer)
        specials.update(tok.all_special_tokens,
                        (t.content for t in tok.added_tokens_decoder.values() if t.special))
        m = config.get("model", {})
        runs.append({"path": str(path), "model": tokenizer or m.get("path") or
                     f"built-in {m.get('kind', 'dense')}-{m.get('size', 'tiny')}"})
        seen = set()
        for f in files:
            agent = agent_of(config, f)
            eps += episodes(read_rows(f), tok, i, agent)
            if (failed := f.parent / "failed_rollouts.jsonl") not in seen:
                seen.add(failed)
                eps += failures(failed, i, agent)
    data = {"runs": runs, "episodes": eps, "special": sorted(specials)}
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")  # (inside <script>)
    return TEMPLATE.read_text().replace("__DATA__", blob, 1), data


def write(paths: list[str], out: str = "", tokenizer: str = "") -> Path:
    """`instar view`: write the page of `paths` to `out` (default: view.html in the first run
    directory, or the samples file's name with .html); returns where."""
    if not paths:
        raise ValueError("give a run directory or a samples file (rollouts.jsonl)")
    ps = [Path(p) for p in paths]
    html, _ = page(ps, tokenizer)
    dest = Path(out or (ps[0] / "view.html" if ps[0].is_dir() else ps[0].with_suffix(".html")))
    dest.write_text(html)
    return dest
