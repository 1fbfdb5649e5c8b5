import dataclasses
import re
import subprocess
import sys

import pytest
import yaml

from instar.cli import SECTIONS, main, parse
from instar.config import Config, cores, from_dict, load_yaml


def test_default_config_is_valid():
    Config().validate()


def changed(**settings) -> Config:
    """A default Config with `settings` ("section__field": value) changed."""
    cfg = Config()
    for name, value in settings.items():
        section, key = name.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


@pytest.mark.parametrize("settings, flag", [
    (dict(rollout__group_size=1), "--rollout.group-size"),
    (dict(rollout__temperature=0.0), "--rollout.temperature"),
    (dict(eval__temperature=-0.5), "--eval.temperature >= 0"),
    (dict(rollout__max_tokens=4096), "--rollout.max-tokens"),
    (dict(train__num_ranks=0), "--train.num-ranks"),
    (dict(data__prompts_per_step=0), "--data.prompts-per-step"),
    (dict(algo__clip_low=1.5), "--algo.clip-low"),
    (dict(rollout__max_staleness=-1), "--rollout.max-staleness"),
    (dict(algo__dual_clip=0.5), "--algo.dual-clip"),
    (dict(algo__epochs=0), "--algo.epochs"),
    (dict(algo__mini_batches=10**6), "--algo.mini-batches"),
    (dict(algo__reward_scale=0.0), "--algo.reward-scale"),
    (dict(algo__kl_coef=0.1, algo__kl_horizon=0), "--algo.kl-horizon"),
    (dict(algo__overlong_buffer=10**6), "--algo.overlong-buffer"),
    (dict(algo__max_resample=4), "--algo.max-resample 4 has no effect unless --algo.dynamic-filter"),
    (dict(algo__kl_target=0.01), "--algo.kl-target 0.01 has no effect unless --algo.kl-coef"),
    (dict(algo__overlong_penalty=0.5), "--algo.overlong-penalty 0.5 has no effect"),
    (dict(data__task="reverse", data__train="t.jsonl", agent__file="a.py", model__path="m"),
     "--data.task reverse has no effect unless --data.train, --agent or --model.path"),
    (dict(algo__estimator="on_policy_distill"), "--algo.teacher"),
    (dict(algo__estimator="grpo2"), "--algo.estimator 'grpo2' is unknown; known: reinforce, "),
    (dict(serve__sessions=0), "--serve.sessions"),
    (dict(train__master_dtype="bfloat16"), "--train.master-dtype bfloat16"),
    (dict(rollout__transport="nccl"), "--rollout.transport nccl needs GPUs"),
    (dict(rollout__tensor_parallel=0), "--rollout.tensor-parallel"),
    (dict(rollout__transport="ipc", cluster__device="cuda", rollout__num_engines=3,
          rollout__max_staleness=0), "--rollout.transport ipc needs an engine per trainer rank"),
    (dict(rollout__tensor_parallel=2, rollout__placement="disaggregated"),
     "--rollout.tensor-parallel 2 needs --cluster.device cuda and --rollout.placement "
     "disaggregated: such an engine spans 2 GPUs of its own"),
    (dict(rollout__tensor_parallel=2, cluster__device="cuda"),  # (colocated, the default)
     "--rollout.tensor-parallel 2 needs --cluster.device cuda and --rollout.placement "
     "disaggregated"),
    # settings that would be ignored: each names itself and what would make it count
    (dict(algo__dual_clip=2.0, algo__policy_loss="gspo"),
     "--algo.dual-clip 2.0 has no effect unless --algo.policy-loss ppo"),
    (dict(algo__dual_clip=2.0, algo__policy_loss="cispo"), "--algo.dual-clip 2.0 has no effect"),
    (dict(algo__kl_in_reward=True), "--algo.kl-in-reward has no effect unless --algo.kl-coef > 0"),
    (dict(algo__kl_estimator="k1"), "--algo.kl-estimator k1 has no effect unless --algo.kl-coef"),
    (dict(algo__reference="ref/"), "--algo.reference ref/ has no effect unless --algo.kl-coef"),
    (dict(algo__teacher="t/"), "--algo.teacher t/ has no effect unless --algo.estimator "
     "on_policy_distill"),
    (dict(algo__gamma=0.99), "--algo.gamma 0.99 has no effect unless --algo.estimator gae"),
    (dict(algo__lam=0.95), "--algo.lam 0.95 has no effect unless --algo.estimator gae"),
    (dict(algo__critic_lr=1e-4), "--algo.critic-lr 0.0001 has no effect unless --algo.estimator gae"),
    (dict(algo__value_clip=0.5), "--algo.value-clip 0.5 has no effect unless --algo.estimator gae"),
    (dict(algo__is_level="sequence"), "--algo.is-level sequence has no effect unless --algo.is-mode"),
    (dict(algo__is_low=0.1), "--algo.is-low 0.1 has no effect unless --algo.is-mode"),
    (dict(algo__is_high=5.0), "--algo.is-high 5.0 has no effect unless --algo.is-mode"),
    (dict(train__min_lr_ratio=0.0), "--train.min-lr-ratio 0.0 has no effect unless "
     "--train.lr-schedule cosine"),
    (dict(train__warmup_sft_steps=0, train__warmup_sft_lr=1e-3),
     "--train.warmup-sft-lr 0.001 has no effect unless --train.warmup-sft-steps > 0"),
    (dict(train__warmup_sft_steps=0, train__warmup_sft_batch=8), "--train.warmup-sft-batch 8"),
    (dict(model__path="m", train__warmup_sft_data="demos.jsonl"),  # (0 steps with a model)
     "--train.warmup-sft-data demos.jsonl has no effect unless --train.warmup-sft-steps > 0"),
    (dict(train__cpu_offload=True), "--train.cpu-offload has no effect unless --cluster.device cuda"),
    (dict(rollout__gpu_memory=0.9), "--rollout.gpu-memory 0.9 has no effect unless "
     "--cluster.device cuda"),
    (dict(cluster__device="cuda", rollout__max_staleness=0, rollout__kv_cache_gb=4),
     "--rollout.kv-cache-gb 4 has no effect unless --cluster.device cpu"),
    (dict(rollout__max_retries=5), "--rollout.max-retries 5 has no effect unless "
     "--rollout.on-failure retry"),
    (dict(rollout__preflight=0, rollout__preflight_tol=0.1), "--rollout.preflight-tol 0.1 has no "
     "effect unless --rollout.preflight > 0"),
    (dict(cluster__engine_resource="gpu_a"), "--cluster.engine-resource gpu_a has no effect "
     "unless --rollout.placement disaggregated"),
    (dict(cluster__trainer_resource="gpu_b"), "--cluster.trainer-resource gpu_b has no effect"),
    (dict(eval__size=0, data__eval="held_out.jsonl"), "--data.eval held_out.jsonl has no effect "
     "unless --eval.size > 0"),
    (dict(eval__size=0, eval__every=5), "--eval.every 5 has no effect unless --eval.size > 0"),
    (dict(eval__size=0, eval__samples=4), "--eval.samples 4 has no effect"),
    (dict(eval__size=0, eval__temperature=0.6), "--eval.temperature 0.6 has no effect"),
    (dict(eval__size=0, eval__max_tokens=64), "--eval.max-tokens 64 has no effect"),
    (dict(eval__size=0, eval__pass_threshold=0.5), "--eval.pass-threshold 0.5 has no effect"),
    (dict(rollout__hang_s=-1.0), "--rollout.hang-s must be >= 0"),
    (dict(rollout__max_request_mb=0.0), "--rollout.max-request-mb > 0"),
    (dict(checkpoint__keep=5), "--checkpoint.keep 5 has no effect unless --checkpoint.every > 0"),
    (dict(checkpoint__resume="newest"), "--checkpoint.resume takes auto"),
    (dict(checkpoint__resume=True, logging__name="run"), "--checkpoint.resume takes auto"),
    (dict(checkpoint__resume="auto"), "--checkpoint.resume auto needs --logging.name"),
    (dict(model__path="ckpt/", model__size="small"), "--model.size small has no effect unless "
     "--model.path is empty"),
    (dict(model__path="ckpt/", model__seed=1), "--model.seed 1 has no effect"),
    (dict(model__path="ckpt/", model__kind="moe"), "--model.kind moe has no effect"),
    (dict(lora__rank=1000), "--lora.rank must be in [0, 512]"),
    (dict(lora__alpha=8.0), "--lora.alpha 8.0 has no effect unless --lora.rank > 0"),
    (dict(lora__rank=8, train__freeze=["embed"]), "--train.freeze ['embed'] has no effect unless "
     "--lora.rank 0"),
    (dict(lora__rank=8, lora__path="adapter/"), "--lora.path serves a trained adapter"),
    (dict(lora__rank=8, cluster__device="cuda", rollout__placement="disaggregated",
          rollout__transport="nccl"), "leave out --rollout.transport nccl"),
    (dict(logging__bundle_every=-1), "--logging.bundle-every must be >= 0"),
])
def test_validate_names_the_flag(settings, flag):
    with pytest.raises(ValueError, match=re.escape(flag)):
        changed(**settings).validate()


@pytest.mark.parametrize("settings", [
    dict(algo__dual_clip=3.0),
    dict(algo__epochs=2, algo__mini_batches=4, algo__entropy_coef=0.01, algo__whiten="group"),
    dict(algo__reward_scale=0.5, algo__reward_clip=1.0, algo__overlong_buffer=8,
         algo__overlong_penalty=0.5, algo__overlong_mask=True),
    dict(algo__kl_coef=0.1, algo__kl_target=0.01, algo__kl_horizon=1000),
    dict(algo__dynamic_filter=True, algo__max_resample=0),
    dict(algo__estimator="turn_rloo"),
    dict(algo__kl_coef=0.1, algo__kl_in_reward=True, algo__kl_estimator="k2", algo__reference="r"),
    dict(algo__estimator="gae", algo__gamma=0.99, algo__lam=0.95, algo__critic_lr=1e-4),
    dict(algo__is_mode="mask", algo__is_level="geometric", algo__is_high=3.0),
    dict(train__lr_schedule="cosine", train__min_lr_ratio=0.0),
    dict(rollout__on_failure="retry", rollout__max_retries=5),
    dict(eval__size=8, eval__every=2, eval__samples=4),
    dict(eval__size=8, eval__temperature=0.0),  # greedy eval (nothing trains on it)
    dict(checkpoint__every=10, checkpoint__keep=5),
    dict(checkpoint__resume="auto", logging__name="run"),
    dict(model__path="ckpt/", model__dtype="bfloat16"),
    dict(cluster__device="cuda", rollout__placement="disaggregated", rollout__tensor_parallel=2,
         rollout__transport="nccl"),
    dict(lora__rank=16, lora__alpha=32.0, lora__dropout=0.05, lora__targets=r".*\.q_proj",
         lora__merge=True),
])
def test_settings_that_count_are_accepted(settings):
    changed(**settings).validate()


def test_yaml_recipe_and_unknown_keys(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  steps: 3\nrollout:\n  group_size: 4\n")
    cfg = load_yaml(str(recipe))
    assert (cfg.train.steps, cfg.rollout.group_size, cfg.train.lr) == (3, 4, Config().train.lr)
    with pytest.raises(ValueError, match="unknown config key train.stepz"):
        from_dict(Config, {"train": {"stepz": 3}})


@pytest.mark.parametrize("text, error", [
    ("train:\n  lr: 1e-6\n", None),  # YAML 1.1 reads this as a string: it is a float here
    ("train:\n  steps: ten\n", "recipe .*: train.steps: expected int, got 'ten'"),
    ("rollout:\n  placement: split\n", "rollout.placement: expected one of \\['colocated'"),
    ("train: [1]\n", "train: expected a mapping"),
    ("train:\n  lr: [\n", "cannot read the recipe"),
])
def test_a_recipe_is_typed_and_its_errors_name_the_key(tmp_path, capsys, text, error):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    if error is None:
        assert load_yaml(str(recipe)).train.lr == 1e-6
        return
    with pytest.raises(ValueError, match=error):
        load_yaml(str(recipe))
    with pytest.raises(SystemExit) as exit_:
        parse("rl", ["--config", str(recipe)])
    stderr = capsys.readouterr().err  # one line, no traceback
    assert exit_.value.code == 2 and stderr.startswith("instar rl: error: ")
    assert re.search(error, stderr) and stderr.count("\n") == 1


def test_a_missing_recipe_is_one_line(capsys):
    with pytest.raises(SystemExit):
        parse("rl", ["--config", "missing.yaml"])
    assert capsys.readouterr().err.startswith("instar rl: error: cannot read the recipe "
                                              "missing.yaml")


FLAGS = {  # every flag of each section, as --help shows it
    "model": "path kind size seed dtype tool-parser reasoning-parser",
    "data": "train eval task prompt-key label-key prompts-per-step seed",
    "agent": "file config max-turns max-tokens timeout-s judge",
    "rollout": "group-size temperature max-tokens ignore-eos max-model-len kv-cache-gb num-engines "
               "threads tensor-parallel placement gpu-memory transport partial schedule max-staleness "
               "on-failure max-retries preflight preflight-tol sync-check-tol hang-s max-request-mb runners",
    "eval": "size every samples temperature max-tokens pass-threshold",
    "lora": "rank alpha dropout targets merge path",
    "train": "steps num-ranks freeze threads-per-rank lr lr-warmup-steps lr-schedule min-lr-ratio "
             "weight-decay grad-clip micro-batch-tokens activation-checkpointing cpu-offload "
             "master-dtype routing-replay warmup-sft-steps warmup-sft-lr warmup-sft-batch "
             "warmup-sft-data",
    "algo": "estimator policy-loss aggregation clip-low clip-high dual-clip is-mode is-level "
            "is-low is-high kl-coef kl-estimator kl-in-reward reference teacher gamma lam "
            "critic-lr value-clip dynamic-filter max-resample epochs mini-batches entropy-coef "
            "whiten reward-scale reward-clip kl-target kl-horizon overlong-buffer "
            "overlong-penalty overlong-mask",
    "health": "tool-parse-failures tool-calls infra-errors no-spread-groups truncated",
    "checkpoint": "save-final every keep resume",
    "logging": "root name progress tensorboard wandb-project rollouts-every plots print-every "
               "bundle-every",
    "cluster": "device ray-address engine-resource trainer-resource runner-resource",
    "serve": "sessions",
}
COMMAND_SECTIONS = {  # the sections each command's --help shows
    "rl": "model data agent rollout eval lora train algo health checkpoint logging cluster",
    "sft": "model data eval lora train checkpoint logging cluster",
    "eval": "model data agent rollout eval lora logging cluster",
    "rollout": "model data agent rollout lora logging cluster",
    "serve": "model rollout lora logging cluster serve",
}


def help_entries(command: str, monkeypatch, capsys) -> dict[str, str]:
    """`instar COMMAND --help`: each flag with its help text (words only: no wrapping, boxes)."""
    monkeypatch.setenv("COLUMNS", "100")  # one column of sections
    with pytest.raises(SystemExit):
        main([command, "--help"])
    entries, flag = {}, None
    for line in capsys.readouterr().out.splitlines():
        if m := re.match(r"[│ ] ?(--[a-z][\w.-]*)(.*)", line):
            flag, entries[m[1]] = m[1], m[2]
        elif not re.search(r"\w", line):  # a blank line or a box's edge ends a section
            flag = None
        elif flag:
            entries[flag] += " " + line
    return {f: " ".join(text.replace("│", " ").split()) for f, text in entries.items()}


@pytest.mark.parametrize("command", COMMAND_SECTIONS)
def test_flag_surface_is_frozen(command, monkeypatch, capsys):
    """Adding, renaming or removing a flag, or showing a section in one more command, must be
    a visible edit here; commands show only the sections they read."""
    expected = {f"--{section}.{name}" for section in COMMAND_SECTIONS[command].split()
                for name in FLAGS[section].split()}
    assert set(help_entries(command, monkeypatch, capsys)) == expected
    assert set(SECTIONS[command]) == set(COMMAND_SECTIONS[command].split())
    assert set(SECTIONS["rl"]) | {"serve"} == {f.name for f in dataclasses.fields(Config)}


def test_a_setting_reads_the_same_in_every_command(monkeypatch, capsys):
    """`instar rollout --help` and `instar rl --help` (and the others) show the same flag, help
    text and default for every setting they share."""
    rl = help_entries("rl", monkeypatch, capsys)
    for command in ("sft", "eval", "rollout", "serve"):
        for flag, text in help_entries(command, monkeypatch, capsys).items():
            if flag.split(".")[0][2:] in SECTIONS["rl"]:
                assert text == rl[flag], (command, flag)


def test_a_registered_estimator_is_a_choice(monkeypatch, capsys):
    """Adding an estimator is one decorated function: the flag, --help and validate() take it,
    and an unknown name is refused with the known ones."""
    from instar.train import advantages

    monkeypatch.setattr(advantages, "ESTIMATORS", dict(advantages.ESTIMATORS))

    @advantages.estimator("batch_mean")
    def batch_mean(x):
        return (advantages.returns_BT(x) - x.rewards_B.mean()) * x.mask_BT

    cfg, _ = parse("rl", ["--algo.estimator", "batch_mean"])
    assert cfg.algo.estimator == "batch_mean"
    assert "batch_mean" in help_entries("rl", monkeypatch, capsys)["--algo.estimator"]
    with pytest.raises(SystemExit):
        parse("rl", ["--algo.estimator", "batch_men"])
    assert "batch_mean" in capsys.readouterr().err
    cfg.algo.estimator = "batch_men"
    with pytest.raises(ValueError, match="'batch_men' is unknown; known: .*, batch_mean"):
        cfg.validate()


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
    expected = {s: dataclasses.asdict(getattr(Config().validate(), s)) for s in SECTIONS["rl"]}
    expected["train"]["steps"], expected["rollout"]["group_size"] = 7, 4
    assert printed == yaml.safe_load(yaml.safe_dump(expected))  # (tuples print as lists)


def test_own_model_gets_a_pretrained_models_defaults():
    """The toy settings (a supervised warm-up, a high lr, short replies) are the built-in
    model's, each built-in task's own; with --model.path only RL trains the model, at a
    pretrained model's settings. The resolved values are what --print-config (and
    config.yaml) show."""
    def printed(*flags, command="rl"):
        out = run_cli(command, *flags, "--print-config")
        assert out.returncode == 0, out.stderr
        return yaml.safe_load(out.stdout)

    def settings(c):
        return (c["train"]["warmup_sft_steps"], c["train"]["warmup_sft_batch"], c["train"]["lr"],
                c["train"]["steps"], c["data"]["prompts_per_step"], c["rollout"]["max_tokens"])

    builtin, own = printed(), printed("--model.path", "some/model")
    assert builtin["data"]["task"] == "tool_use"
    assert settings(builtin) == (425, 16, 3e-4, 60, 8, 80)
    assert settings(printed("--data.task", "reverse")) == (60, 64, 1e-3, 150, 16, 24)
    sft = printed(command="sft")  # (sft does not run the task: the generic tiny settings)
    assert (sft["train"]["lr"], sft["train"]["steps"], sft["data"]["prompts_per_step"]) == (
        1e-3, 150, 16)
    out = run_cli("sft", "--data.task", "reverse", "--print-config")
    assert out.returncode == 2 and "--data.task reverse has no effect unless instar rl" in out.stderr
    assert (own["train"]["warmup_sft_steps"], own["train"]["lr"], own["rollout"]["max_tokens"],
            own["rollout"]["max_model_len"]) == (0, 1e-6, 1024, 4096)
    assert own["cluster"]["device"] == "cpu"  # auto, on this machine
    tuned = printed("--model.path", "some/model", "--train.lr", "3e-6", "--model.dtype", "bfloat16")
    assert tuned["train"]["lr"] == 3e-6 and tuned["rollout"]["sync_check_tol"] == 5e-2
    assert tuned["rollout"]["preflight_tol"] == 3e-2


def test_a_gpu_run_without_placement_flags_validates():
    """Engines colocated on GPUs sleep while the trainer trains: the plain GPU command is a
    valid layout (auto runs it sequentially, which meets any staleness bound); overlap is
    refused there, with the reason."""
    cfg, _ = parse("rl", ["--cluster.device", "cuda"])
    assert cfg.rollout.placement == "colocated"
    assert cfg.schedule_for()[0] == "sequential"
    cfg, _ = parse("rl", ["--cluster.device", "cuda", "--rollout.max-staleness", "2"])
    assert cfg.rollout.max_staleness == 2  # an explicit bound is never rewritten
    cfg, _ = parse("rl", ["--cluster.device", "cuda", "--rollout.placement", "disaggregated"])
    assert cfg.schedule_for()[0] == "overlap"
    with pytest.raises(SystemExit):
        parse("rl", ["--cluster.device", "cuda", "--rollout.schedule", "overlap"])


@pytest.mark.parametrize("flags, cores, plan", [
    ([], cores(), "sequential"),  # the defaults: each side takes every core, so they take turns
    (["--rollout.threads", "1", "--train.num-ranks", "1", "--train.threads-per-rank", "1"], 2,
     "overlap"),  # 1 + 1 threads on 2 cores: nothing is shared
    (["--rollout.threads", "2", "--train.threads-per-rank", "1"], 16, "overlap"),  # 2 + 2 x 1
    (["--rollout.threads", "2", "--train.threads-per-rank", "1"], 2, "sequential"),
    (["--rollout.placement", "disaggregated"], 2, "overlap"),  # cores of their own
    (["--rollout.threads", "2", "--data.prompts-per-step", "4", "--rollout.group-size", "4"], 2,
     "overlap"),  # 8 sequences per engine thread: decoding leaves a core idle (bench's long)
    (["--rollout.threads", "2", "--data.prompts-per-step", "8", "--rollout.group-size", "8"], 2,
     "sequential"),  # 32 per thread
    (["--rollout.schedule", "overlap"], 2, "overlap"),  # asked for: kept
    (["--rollout.schedule", "sequential", "--rollout.threads", "1", "--train.num-ranks", "1",
      "--train.threads-per-rank", "1"], 64, "sequential"),
])
def test_the_schedule_auto_chooses(flags, cores, plan):
    cfg, _ = parse("rl", flags)
    assert cfg.schedule_for(cores)[0] == plan


def test_thread_counts_default_to_the_machines_cores():
    cfg, _ = parse("rl", ["--rollout.num-engines", "2", "--train.num-ranks", "4"])
    assert cfg.rollout.threads == max(1, cores() // 2)
    assert cfg.train.threads_per_rank == max(1, cores() // 4)
    cfg, _ = parse("rl", ["--rollout.placement", "disaggregated"])  # 1 engine, 2 ranks: a third
    assert cfg.rollout.threads == cfg.train.threads_per_rank == max(1, cores() // 3)
    with pytest.raises(SystemExit):
        parse("rl", ["--rollout.threads", "0"])


def test_cli_config_error_is_a_clear_message():
    out = run_cli("rl", "--rollout.group-size", "1")
    assert out.returncode != 0
    assert "instar rl: error: --rollout.group-size must be at least 2" in out.stderr
    assert out.returncode == 2
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("command", ["eval", "rollout"])
def test_one_episode_per_task_is_fine_without_training(command):
    cfg, _ = parse(command, ["--rollout.group-size", "1"])
    assert cfg.rollout.group_size == 1
    with pytest.raises(SystemExit):
        parse(command, ["--rollout.group-size", "0"])


@pytest.mark.parametrize("command", ["rl", "eval", "rollout"])
def test_agent_shorthand_flag(command):
    cfg, _ = parse(command, ["--agent", "examples/calculator_env.py"])
    assert cfg.agent.file == "examples/calculator_env.py"


def test_a_command_prints_and_sets_only_its_sections(tmp_path, capsys):
    """A recipe serves every command (rl's recipe for `instar eval`); each reads its sections."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  steps: 7\nrollout:\n  max_tokens: 64\n")
    cfg, printed = parse("rollout", ["--config", str(recipe), "--rollout.group-size", "2",
                                     "--print-config"])
    assert printed and (cfg.train.steps, cfg.rollout.max_tokens, cfg.rollout.group_size) == (7, 64, 2)
    assert list(yaml.safe_load(capsys.readouterr().out)) == list(SECTIONS["rollout"])
    with pytest.raises(SystemExit):
        parse("rollout", ["--train.steps", "3"])  # not a flag of rollout


def test_instar_help_lists_the_commands_and_version_prints(capsys):
    main(["--help"])  # exits 0: returns
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in ("rl", "sft", "eval", "rollout", "serve",
                                                "make-model", "check-model", "view", "replay"))
    main(["--version"])
    assert re.fullmatch(r"instar \d+\.\d+\.\d+\n", capsys.readouterr().out)
    for argv in ([], ["trian"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "commands:" in capsys.readouterr().err


def test_rollout_exits_nonzero_when_every_episode_failed(monkeypatch):
    import instar.jobs

    monkeypatch.setattr(instar.jobs, "rollout", lambda cfg, inputs: {"episodes": 0, "failed": {
        "agent_error": 8}})
    with pytest.raises(SystemExit, match="every episode failed: {'agent_error': 8}"):
        main(["rollout"])
    monkeypatch.setattr(instar.jobs, "rollout", lambda cfg, inputs: {"episodes": 7, "failed": {
        "agent_error": 1}})
    main(["rollout"])  # some episodes ran: exit 0


def test_eval_exits_nonzero_when_every_episode_failed(monkeypatch):
    import instar.jobs

    monkeypatch.setattr(instar.jobs, "evaluate_model", lambda cfg, inputs: {"tasks": 2, "failed": {
        "timeout": 2 * cfg.eval.samples}})
    with pytest.raises(SystemExit, match="every episode failed: {'timeout': 2}"):
        main(["eval"])
    monkeypatch.setattr(instar.jobs, "evaluate_model", lambda cfg, inputs: {"tasks": 2, "failed": {
        "timeout": 1}})
    main(["eval", "--eval.samples", "2"])  # 1 of 4 failed: exit 0


@pytest.mark.parametrize("command, flags, error", [
    ("rollout", ["--lora.rank", "8"], "--lora.rank trains an adapter (instar rl, instar sft)"),
    ("rl", ["--lora.path", "adapter/"], "--lora.path serves a trained adapter"),
])
def test_lora_flags_belong_to_their_commands(command, flags, error, capsys):
    with pytest.raises(SystemExit):
        main([command, *flags])
    assert error in capsys.readouterr().err


RECIPE_ADAPTERS = """
lora:
  rank: 8
  adapters:
    - {name: a, lr: 1.0e-4}
    - {name: b, agent: b.py, train: b.jsonl, max_staleness: 0, agent_config: {k: v}}
"""


def test_lora_adapters_come_from_the_config_file_and_shape_each_lane(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE_ADAPTERS)
    cfg = load_yaml(str(recipe))
    cfg.train.lr, cfg.data.train, cfg.agent.file = 1e-3, "all.jsonl", "all.py"
    (a, ca), (b, cb) = cfg.validate().lanes()
    assert (a, ca.train.lr, ca.agent.file, ca.data.train, ca.rollout.max_staleness) == \
        ("a", 1e-4, "all.py", "all.jsonl", 1)
    assert (b, cb.train.lr, cb.agent.file, cb.agent.config, cb.data.train,
            cb.rollout.max_staleness) == ("b", 1e-3, "b.py", {"k": "v"}, "b.jsonl", 0)
    assert Config().lanes() == [("", Config())]
    recipe.write_text("lora: {adapters: [{name: a, lr: fast}]}")
    with pytest.raises(ValueError, match=re.escape("lora.adapters[0].lr: expected float")):
        load_yaml(str(recipe))
    assert "--lora.adapters" not in subprocess.run(  # (a list of tables: config file only)
        [sys.executable, "-m", "instar.cli", "rl", "--help"], capture_output=True,
        text=True).stdout


@pytest.mark.parametrize("adapters,settings,message", [
    ([{"name": "a"}], {}, "give --lora.rank R too"),
    ([{"name": "a"}, {"name": "a"}], {"lora__rank": 8}, "a name of its own"),
    ([{"name": "a.b"}], {"lora__rank": 8}, "a name of its own"),
    ([{"name": "a", "lr": -1.0}], {"lora__rank": 8}, "lr must be >= 0"),
    ([{"name": "a"}], {"lora__rank": 8, "algo__estimator": "gae"}, "cannot share"),
    ([{"name": "a"}], {"lora__rank": 8, "logging__bundle_every": 2},
     "--logging.bundle-every records the step of one policy"),
])
def test_bad_lora_adapters_are_refused(adapters, settings, message):
    cfg = changed(**settings)
    cfg.lora.adapters = from_dict(Config, {"lora": {"adapters": adapters}}).lora.adapters
    with pytest.raises(ValueError, match=re.escape(message)):
        cfg.validate()


def test_health_thresholds_round_trip_through_a_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(Config().to_yaml().replace("- 0.5\n", "- 0.25\n", 1))
    assert load_yaml(str(recipe)).health.tool_parse_failures == (0.25, 1.0)
    recipe.write_text("health: {truncated: [0.5]}")
    with pytest.raises(ValueError, match=re.escape("health.truncated: expected tuple")):
        load_yaml(str(recipe))
