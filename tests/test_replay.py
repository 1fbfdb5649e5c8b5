"""Replay bundles (instar/bundle.py, instar/replay.py). The steps of one real 2-rank `instar rl`
run (GAE with its critic, a KL reference, 2 epochs x 2 mini-batches, a bundle every step),
recomputed on this CPU with no Ray or engines, equal the run's: bitwise on 2 ranks (every
train stat, the policy's and the critic's updated weights), to tolerance on 1 rank. A bundle
altered after the run does not replay; a bad path is one line and exit 2."""

import json
import shutil

import pytest
from conftest import instar, step_lines

from instar.bundle import read
from instar.cli import main

FLAGS = ["--data.task", "reverse", "--train.steps", "2", "--train.num-ranks", "2",
         "--train.warmup-sft-steps", "0",
         "--data.prompts-per-step", "4", "--rollout.group-size", "4", "--rollout.max-tokens", "12",
         "--rollout.preflight", "0", "--eval.size", "0", "--algo.estimator", "gae",
         "--algo.kl-coef", "0.01", "--algo.epochs", "2", "--algo.mini-batches", "2",
         "--logging.bundle-every", "1", "--logging.no-tensorboard", "--logging.no-plots"]


@pytest.fixture(scope="module")
def run(ray_session, tmp_path_factory):
    return instar(tmp_path_factory.mktemp("replay"), "rl", *FLAGS)


def replay(capsys, *args: str) -> tuple[int, str, str]:
    """`instar replay ARGS`: its exit code, stdout and stderr."""
    code, message = 0, ""
    try:
        main(["replay", *args])
    except SystemExit as e:  # (sys.exit("message"): the message on stderr, exit code 1)
        code, message = (e.code, "") if isinstance(e.code, int) else (1, e.code)
    out, err = capsys.readouterr()
    return code, out, err + message


@pytest.mark.stack
@pytest.mark.parametrize("step", [1, 2])
def test_a_replayed_step_is_bitwise_the_runs(run, step):
    from instar.replay import rerun  # (torch, the loop: not for the fast test below)

    bundle = read(str(run / "bundles" / f"step-{step:08d}"))
    recorded = bundle.meta["outcome"]
    assert (bundle.folder / "before").exists() == (step > 1)  # step 1: AdamW fresh, no before/
    assert recorded["loss"] == step_lines(run)[step]["train/loss"]  # the run's own step
    assert {"critic_loss", "kl"} <= recorded.keys() and len(recorded["updates"]) == 4
    result = rerun(bundle)  # on the run's 2 ranks
    assert result["stats"] == recorded  # loss, grad norm, clip fraction, each update's, ...
    assert result["weights"] == 0.0 and result["critic_weights"] == 0.0
    assert result["moved"] > 1e-3  # (the step did move the weights)


@pytest.mark.stack
def test_a_2_rank_step_replays_on_1_rank_to_tolerance(run, capsys):
    code, out, _ = replay(capsys, str(run / "bundles" / "step-00000002"), "--ranks", "1",
                          "--tolerance", "1e-5")
    assert code == 0, out
    assert "(trained on 2 ranks, replayed on 1 rank)" in out and "weights         max |Δ|" in out
    assert "critic_loss" in out and "critic weights  max |Δ|" in out  # (its head: no dropout)


@pytest.mark.stack
def test_an_altered_bundle_does_not_replay(run, tmp_path, capsys):
    bundle = shutil.copytree(run / "bundles" / "step-00000002", tmp_path / "step-00000002")
    samples = [json.loads(line) for line in (bundle / "samples.jsonl").read_text().splitlines()]
    k = samples[0]["loss_mask"].index(True)
    samples[0]["tokens"][k] ^= 1  # another generated token
    (bundle / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    code, out, err = replay(capsys, str(bundle), "--ranks", "1", "--tolerance", "1e-5")
    assert code == 1 and "differs from the run beyond --tolerance 1e-05" in err, out


def test_a_bad_bundle_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("instar.cli.DEBUG", False)
    for name, meta in [("old", '{"schema": 0}'), ("garbled", "{schema"), ("listed", "[1]"),
                       ("unmoored", '{"schema": 1, "model": "/no/such/model"}'),
                       ("cut", json.dumps({"schema": 1, "model": str(tmp_path)}))]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "bundle.json").write_text(meta)
    for path, error in [(tmp_path / "none", "not a replay bundle (no bundle.json"),
                        (tmp_path / "old", "bundle schema 0; this instar reads schema 1"),
                        (tmp_path / "garbled", "bundle.json is not JSON"),
                        (tmp_path / "listed", "bundle schema None"),
                        (tmp_path / "unmoored", "the run's starting checkpoint /no/such/model "
                                                "is gone"),
                        (tmp_path / "cut", "after/, the weights the step gave, is missing")]:
        code, _, err = replay(capsys, str(path))
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"instar replay: error: {path}: {error}"), err
    for flags in (["--ranks", "-1"], ["--tolerance", "-1"]):
        code, _, err = replay(capsys, str(tmp_path / "none"), *flags)
        assert code == 2 and "--ranks and --tolerance must be >= 0" in err, err
