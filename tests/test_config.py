import dataclasses
import subprocess
import sys

import pytest
import yaml

from instar.config import Config, from_dict, load_yaml


def test_default_config_is_valid():
    Config().validate()


@pytest.mark.parametrize("change, flag", [
    (lambda c: setattr(c.rollout, "group_size", 1), "--rollout.group-size"),
    (lambda c: setattr(c.rollout, "temperature", 0.0), "--rollout.temperature"),
    (lambda c: setattr(c.rollout, "max_tokens", 4096), "--rollout.max-tokens"),
    (lambda c: setattr(c.train, "num_ranks", 0), "--train.num-ranks"),
    (lambda c: setattr(c.data, "prompts_per_step", 0), "--data.prompts-per-step"),
    (lambda c: setattr(c.algo, "clip_low", 1.5), "--algo.clip-low"),
    (lambda c: setattr(c.rollout, "max_staleness", -1), "--rollout.max-staleness"),
    (lambda c: setattr(c.algo, "dual_clip", 0.5), "--algo.dual-clip"),
    (lambda c: setattr(c.algo, "estimator", "on_policy_distill"), "--algo.teacher"),
    (lambda c: setattr(c.train, "cpu_offload", True), "--train.cpu-offload"),
    (lambda c: setattr(c.train, "master_dtype", "bfloat16"), "--train.master-dtype bfloat16"),
    (lambda c: setattr(c.rollout, "transport", "nccl"), "--rollout.transport nccl needs GPUs"),
    (lambda c: setattr(c.cluster, "engine_resource", "gpu_a"), "--rollout.placement disaggregated"),
])
def test_validate_names_the_flag(change, flag):
    cfg = Config()
    change(cfg)
    with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
        cfg.validate()


def test_yaml_recipe_and_unknown_keys(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  steps: 3\nrollout:\n  group_size: 4\n")
    cfg = load_yaml(str(recipe))
    assert (cfg.train.steps, cfg.rollout.group_size, cfg.train.lr) == (3, 4, Config().train.lr)
    with pytest.raises(ValueError, match="unknown config keys for TrainConfig: \\['stepz'\\]"):
        from_dict(Config, {"train": {"stepz": 3}})


def test_flag_surface_is_frozen():
    """Adding or removing a config field must be a visible edit here."""
    names = sorted(f"{g.name}.{f.name}" for g in dataclasses.fields(Config)
                   for f in dataclasses.fields(g.type))
    assert names == sorted("""
        agent.config agent.file agent.judge agent.max_tokens agent.max_turns agent.timeout_s algo.clip_high algo.clip_low algo.estimator algo.policy_loss algo.aggregation algo.dual_clip algo.is_mode algo.is_level algo.is_low algo.is_high algo.kl_coef algo.kl_estimator algo.kl_in_reward algo.reference algo.teacher algo.gamma algo.lam algo.critic_lr algo.value_clip algo.dynamic_filter
        checkpoint.save_final checkpoint.every checkpoint.keep checkpoint.resume data.eval data.prompts_per_step eval.size eval.every eval.samples eval.temperature eval.max_tokens eval.pass_threshold data.seed
        data.train logging.name logging.progress logging.root logging.tensorboard logging.wandb_project logging.rollouts_every logging.plots model.dtype model.kind
        model.path model.seed model.size rollout.group_size rollout.on_failure rollout.max_retries rollout.preflight rollout.preflight_tol
        rollout.kv_cache_gb rollout.max_model_len rollout.max_tokens rollout.ignore_eos rollout.num_engines rollout.sync_check_tol
        rollout.temperature rollout.threads rollout.placement rollout.gpu_memory rollout.partial
        rollout.max_staleness rollout.transport train.freeze train.device train.grad_clip train.lr train.micro_batch_tokens train.lr_warmup_steps train.lr_schedule train.min_lr_ratio train.activation_checkpointing train.cpu_offload
        train.master_dtype train.routing_replay
        train.num_ranks train.steps train.threads_per_rank train.warmup_sft_batch
        train.warmup_sft_lr train.warmup_sft_steps train.weight_decay
        cluster.ray_address cluster.engine_resource cluster.trainer_resource""".split())


def test_every_field_is_read_somewhere():
    """No dead flags: each field name appears outside config.py."""
    from pathlib import Path

    import instar

    root = Path(instar.__file__).parent
    code = "\n".join(p.read_text() for p in root.rglob("*.py") if p.name != "config.py")
    for group in dataclasses.fields(Config):
        for f in dataclasses.fields(group.type):
            assert f".{f.name}" in code, f"config field {group.name}.{f.name} is never read"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "instar.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_print_config_prints_the_resolved_config(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  steps: 7\n")
    out = run_cli("rl", "--config", str(recipe), "--rollout.group-size", "4", "--print-config")
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    expected = dataclasses.asdict(Config())
    expected["train"]["steps"], expected["rollout"]["group_size"] = 7, 4
    assert printed == expected


def test_cli_config_error_is_a_clear_message():
    out = run_cli("rl", "--rollout.group-size", "1")
    assert out.returncode != 0
    assert "config error: --rollout.group-size must be at least 2" in out.stderr
    assert "Traceback" not in out.stderr


def test_agent_shorthand_flag():
    out = run_cli("rl", "--agent", "examples/calculator_env.py", "--print-config")
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["agent"]["file"] == "examples/calculator_env.py"
