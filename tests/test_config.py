"""RunConfig: validation, YAML round trip, unknown keys, presets, demo."""

import pytest

from workbench.config import (
    TINY_VOCAB_SIZE,
    ConfigError,
    DataConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    preset_config,
)


def test_yaml_round_trip(tmp_path):
    rc = RunConfig.demo(
        train__steps=7, train__lr=1e-3, data__seq_len=64, model__layers=3, output_dir=str(tmp_path), run_id="abc"
    )
    path = tmp_path / "cfg.yaml"
    rc.to_yaml(path)
    back = RunConfig.from_yaml(path)
    assert back == rc
    assert back.train.steps == 7 and back.data.seq_len == 64 and back.model.layers == 3
    assert RunConfig.from_dict(rc.to_dict()) == rc


def test_unknown_top_level_key_names_it_and_the_allowed_ones(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {preset: tiny}\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError) as info:
        RunConfig.from_yaml(path)
    msg = str(info.value)
    assert "learning_rate" in msg and "train" in msg and str(path) in msg


@pytest.mark.parametrize(
    "section,key", [("train", "stepz"), ("data", "seqlen"), ("model", "hidden"), ("backend", "expert")]
)
def test_unknown_nested_key(section, key):
    data = RunConfig.demo().to_dict()
    data[section] = {**data[section], key: 1}
    with pytest.raises(ValueError) as info:
        RunConfig.from_dict(data)
    assert key in str(info.value)


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: TrainConfig(steps=0), "train.steps"),
        (lambda: TrainConfig(global_batch_size=6, local_batch_size=4), "multiple"),
        (lambda: TrainConfig(min_lr_ratio=2.0), "min_lr_ratio"),
        (lambda: TrainConfig(betas=(0.9, 1.5)), "betas"),
        (lambda: ModelConfig(dtype="fp8"), "model.dtype"),
        (lambda: ModelConfig(preset="gpt5"), "unknown model preset"),
        (lambda: ModelConfig(preset="tiny", path="/x"), "exactly one"),
        (lambda: ModelConfig(layers=0), "model.layers"),
        (lambda: DataConfig(kind="parquet"), "data.kind"),
        (lambda: DataConfig(seq_len=64, max_length=128), "max_length"),
        (lambda: DataConfig(kind="synthetic", path="x.jsonl"), "data.path"),
        (lambda: RunConfig(run_id="a/b"), "run_id"),
    ],
)
def test_validation_errors(make, needle):
    with pytest.raises(ConfigError) as info:
        make()
    assert needle in str(info.value)


def test_accumulation_steps():
    t = TrainConfig(global_batch_size=16, local_batch_size=2)
    assert t.accumulation_steps(1) == 8 and t.accumulation_steps(2) == 4 and t.accumulation_steps(8) == 1
    with pytest.raises(ConfigError, match="data-parallel size"):
        t.accumulation_steps(16)
    with pytest.raises(ConfigError, match="disagrees"):
        TrainConfig(global_batch_size=16, local_batch_size=2, grad_accum=3).accumulation_steps(2)


def test_qwen3_30b_preset_and_layer_override():
    cfg = preset_config("qwen3-30b-a3b")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2048, 32, 4, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers) == (6144, 151936, 48)
    assert cfg.tie_word_embeddings is False and cfg.rope_parameters["rope_theta"] == 1e6
    assert preset_config("qwen3-30b-a3b", layers=16).num_hidden_layers == 16
    assert ModelConfig(preset="qwen3-30b-a3b", layers=8).hf_config().num_hidden_layers == 8
    assert ModelConfig(router_aux_loss_coef=0.0).hf_config().router_aux_loss_coef == 0.0


def test_demo_defaults():
    rc = RunConfig.demo()
    cfg = rc.model.hf_config()
    assert cfg.vocab_size == TINY_VOCAB_SIZE and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert rc.mesh is None  # resolved at run time: dp = ep = world size
    assert rc.data.kind == "jsonl" and rc.data.resolved_path.is_file()
    assert RunConfig.demo(train=TrainConfig(steps=3)).train.steps == 3


def test_from_yaml_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        RunConfig.from_yaml(tmp_path / "nope.yaml")


# -- non-finite numbers --------------------------------------------------------------------------

NON_FINITE_FIELDS = [
    ("train", "lr"),
    ("train", "min_lr_ratio"),
    ("train", "clip_grad_norm"),
    ("train", "weight_decay"),
    ("model", "router_aux_loss_coef"),
]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("section,key", NON_FINITE_FIELDS)
def test_python_api_refuses_non_finite_numbers(section, key, value):
    cls = {"train": TrainConfig, "model": ModelConfig}[section]
    with pytest.raises(ConfigError, match=rf"{section}\.{key} must be a finite number"):
        cls(**{key: value})


@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf", ".NaN"])
@pytest.mark.parametrize("section,key", NON_FINITE_FIELDS)
def test_yaml_refuses_non_finite_numbers(tmp_path, section, key, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(f"{section}:\n  {key}: {text}\n")
    with pytest.raises(ConfigError, match=rf"{path}: {section}\.{key} must be a finite number .* got (nan|inf|-inf)"):
        RunConfig.from_yaml(path)


def test_set_refuses_nan_clip_grad_norm_instead_of_disabling_clipping():
    from workbench.cli import build_parser
    from workbench.cli_common import config_overrides

    args = build_parser().parse_args(["finetune", "cfg.yaml", "--set", "train.clip_grad_norm=.nan"])
    with pytest.raises(ConfigError, match=r"train\.clip_grad_norm must be a finite number >= 0.0, got nan"):
        RunConfig.demo().with_overrides(config_overrides(args))


@pytest.mark.parametrize("betas", [(float("nan"), 0.95), (0.9, float("inf"))])
def test_betas_refuse_non_finite_numbers(betas):
    with pytest.raises(ConfigError, match=r"train\.betas must be two finite numbers"):
        TrainConfig(betas=betas)


# -- numbers as people write them ----------------------------------------------------------------


def test_yaml_reads_exponents_without_a_dot_as_floats(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "model:\n  router_aux_loss_coef: 1E-3\n"
        "train:\n  lr: 1e-3\n  weight_decay: 3e-4\n  clip_grad_norm: 1E5\n  min_lr_ratio: 5e-1\n"
        "run_id: '1e-3'\noutput_dir: 1e-3x\n"
    )
    rc = RunConfig.from_yaml(path)
    assert (rc.train.lr, rc.train.weight_decay, rc.train.clip_grad_norm) == (1e-3, 3e-4, 1e5)
    assert rc.train.min_lr_ratio == 0.5 and rc.model.router_aux_loss_coef == 1e-3
    # a real string (quoted, or not a number) stays a string
    assert rc.run_id == "1e-3" and rc.output_dir == "1e-3x"
    assert RunConfig.from_yaml(rc.to_yaml()) == rc


@pytest.mark.parametrize(
    "text,value",
    [
        ("1e-3", 1e-3),
        ("3e-4", 3e-4),
        ("1E5", 1e5),
        ("-2e+3", -2e3),
        ("1.5e3", 1500.0),
        ("0.001", 0.001),
        ("12", 12),
        ("true", True),
        ("1e-3x", "1e-3x"),
        ("e5", "e5"),
        ("'1e-3'", "1e-3"),
        ("nan", "nan"),
        ("abc", "abc"),
        ("[1, 2e-1]", [1, 0.2]),
    ],
)
def test_load_yaml_changes_only_number_looking_strings(text, value):
    from workbench.config_io import load_yaml

    assert load_yaml(text) == value and type(load_yaml(text)) is type(value)


@pytest.mark.parametrize("lr", [float("nan"), float("inf")])
def test_bench_config_refuses_non_finite_lr(lr):
    from workbench.bench.config import BenchConfig

    with pytest.raises(ConfigError, match=r"BenchConfig.lr must be a positive number \(and finite\), got (nan|inf)"):
        BenchConfig(lr=lr)


def test_clip_grad_norm_zero_is_refused_and_none_turns_clipping_off():
    # clip_grad_norm=0 scales every gradient to zero: a run that cannot train
    with pytest.raises(ConfigError, match=r"clip_grad_norm must be > 0 .*null"):
        TrainConfig(clip_grad_norm=0.0)
    assert TrainConfig(clip_grad_norm=None).clip_grad_norm is None


def test_run_name_round_trips_and_is_checked(tmp_path):
    # `--set name=...` (with_overrides) names a run for the lab sidebar; run_id stays the folder
    rc = RunConfig.demo().with_overrides({"name": "grouped_mm + balanced"})
    assert rc.name == "grouped_mm + balanced" and rc.to_dict()["name"] == rc.name
    assert RunConfig.from_yaml(rc.to_yaml()) == rc and RunConfig.demo().name is None
    for bad in ("", "  ", 3, "x" * 201):
        with pytest.raises(ConfigError, match="name must be a non-empty string"):
            RunConfig(name=bad)
