"""Engines of several GPUs (--rollout.tensor-parallel N) are refused, in one sentence naming
the flag, when no node of the Ray cluster has N GPUs, before anything waits for them."""

import re

import pytest

from instar.placement import check_engine_gpus, check_gpu_count, place


def node(gpus: float, alive: bool = True, **resources) -> dict:
    """A node as `ray.nodes()` describes it."""
    return {"Alive": alive, "Resources": {"CPU": 16.0, "GPU": gpus, **resources}}


@pytest.mark.parametrize("tensor_parallel, nodes, resource", [
    (1, [node(1)], ""),
    (4, [node(2), node(4)], ""),
    (8, [node(8, rollout=8.0), node(8)], "rollout"),
])
def test_an_engine_fits_on_a_node_with_enough_gpus(tensor_parallel, nodes, resource):
    check_engine_gpus(tensor_parallel, nodes, resource)


@pytest.mark.parametrize("tensor_parallel, nodes, resource, most", [
    (2, [node(1), node(1)], "", "has is 1"),  # two nodes of one GPU: an engine is never split
    (4, [node(8, alive=False), node(2)], "", "has is 2"),
    (4, [node(8), node(2, rollout=2.0)], "rollout", "any 'rollout' node of the Ray cluster "
     "has is 2"),
    (2, [node(0)], "", "has is 0"),
])
def test_an_engine_larger_than_every_node_is_refused(tensor_parallel, nodes, resource, most):
    with pytest.raises(RuntimeError, match=f"--rollout.tensor-parallel {tensor_parallel}: an "
                       f"engine needs {tensor_parallel} GPUs on one node, .*{re.escape(most)}"):
        check_engine_gpus(tensor_parallel, nodes, resource)


@pytest.mark.parametrize("mode, bundles, nodes, need", [
    ("colocated", [{"GPU": 1}] * 2, [node(1)], "need 2 GPUs (max(--rollout.num-engines, "),
    ("disaggregated", [{"GPU": 2}, {"GPU": 1}, {"GPU": 1}], [node(2), node(1, alive=False)],
     "need 4 GPUs (--rollout.num-engines x --rollout.tensor-parallel + --train.num-ranks), "
     "but the Ray cluster has 2: lower"),
])
def test_a_layout_larger_than_the_cluster_says_which_flags_to_set(mode, bundles, nodes, need):
    """The default GPU run (colocated, 2 ranks) on a 1-GPU machine: one sentence, at once."""
    with pytest.raises(RuntimeError, match=re.escape(need)):
        check_gpu_count(bundles, nodes, mode)
    check_gpu_count(bundles, [node(8)], mode)  # enough


@pytest.mark.stack
def test_place_refuses_before_waiting(ray_session):
    """On this CPU-only Ray (no GPU at all) at once, not after the placement group's timeout."""
    with pytest.raises(RuntimeError, match="--rollout.tensor-parallel 2: .* has is 0"):
        place("disaggregated", "cuda", 1, 1, 0, 0, tensor_parallel=2, timeout_s=600)


@pytest.mark.stack
def test_the_plain_gpu_command_on_a_cluster_without_gpus_is_one_line(ray_session, tiny_model,
                                                                      tmp_path, monkeypatch,
                                                                      capsys):
    """`instar rl --cluster.device cuda` where the cluster has no GPU: `instar rl: error: ...`
    naming the flags, exit code 2, and no run directory left."""
    from instar.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("instar.cli.DEBUG", False)
    with pytest.raises(SystemExit) as e:
        main(["rl", "--cluster.device", "cuda", "--model.path", str(tiny_model),
              "--logging.root", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("instar rl: error: colocated engines and trainer ranks need 2 GPUs")
    assert "lower --rollout.num-engines or --train.num-ranks" in err[0]
    assert not (tmp_path / "runs").exists()
