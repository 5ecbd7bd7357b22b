"""Config loading, typed dotted overrides, validation messages; every shipped config loads."""

import pytest

from jaxsb.config import CONFIG_DIR, Config, ConfigError, apply_overrides, config_from_json, load_config


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(str(path))
    assert cfg.name == path.stem


def test_overrides_are_typed():
    cfg = load_config("default", ["train.steps=20", "train.lr=1e-3", "model.tie_embeddings=false",
                                  "data.row_buckets=128,256,2048", "model.attention=reference",
                                  "parallel.planner=none", "model.sparse.top_k=4"])
    assert cfg.train.steps == 20 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == 1e-3
    assert cfg.model.tie_embeddings is False
    assert cfg.data.row_buckets == (128, 256, 2048)
    assert cfg.model.attention == "reference"
    assert cfg.model.sparse.top_k == 4 and cfg.model.sparse.block_size == 128


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "train.stepz: unknown key 'stepz' in train; allowed: "),
    ("nosuch.x=1", "nosuch.x: unknown key 'nosuch' in config"),
    ("train.steps=ten", "train.steps: expected an integer, got 'ten'"),
    ("train.steps=0", "train.steps: must be >= 1, got 0"),
    ("model.attention=magic", "model.attention: got 'magic', allowed: xla, flash, sparse, reference, jax"),
    ("model.kv_heads=3", "model.kv_heads: heads=4 must be a multiple of kv_heads=3"),
    ("model.tie_embeddings=maybe", "model.tie_embeddings: expected a boolean"),
    ("data.long_policy=shred", "data.long_policy: got 'shred', allowed: split, truncate, drop"),
    ("data.row_buckets=512,256", "data.row_buckets: must be strictly increasing"),
    ("model=3", "model: is a section"),
    ("train.steps", "expected key=value"),
    ("tokenizer.kind=model", "tokenizer.kind: kind=model needs a pretrained model.init"),
    ("model.sparse.top_k=0", "model.sparse.top_k: must be >= 1"),
    ("model.sparse.blocksize=64", "model.sparse.blocksize: unknown key 'blocksize' in model.sparse"),
    ("model.sparse.policy=lazy", "model.sparse.policy: got 'lazy', allowed: fixed, floor"),
    ("data.kind=mqar;data.mqar.lengths=4096", "data.mqar.lengths: longest 4096 must be <= data.max_len=2048"),
])
def test_bad_overrides_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("default", override.split(";"))
    assert message in str(err.value)


def test_floor_policy_needs_the_floor_and_no_planned_budgets():
    """policy=floor starts documents at budget 1: without the runtime floor (coverage_drop >= 1)
    they would stay there, and with budgets=dst the planner's budgets would be overridden."""
    sparse = ["model.attention=sparse", "model.sparse.policy=floor"]
    assert load_config("default", sparse).model.sparse.start_budget == 1
    assert load_config("default", ["model.attention=sparse"]).model.sparse.start_budget == 8
    with pytest.raises(ConfigError, match="model.sparse.policy: floor starts every document at budget 1"):
        load_config("default", [*sparse, "model.sparse.coverage_drop=1"])
    with pytest.raises(ConfigError, match="model.sparse.policy: parallel.budgets=dst chooses"):
        load_config("default", [*sparse, "parallel.budgets=dst", "model.sparse.max_blocks=16"])


def test_missing_config_lists_shipped_ones():
    with pytest.raises(ConfigError, match="shipped configs: .*default"):
        load_config("no_such_config")


def test_bad_toml_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = = 3\n")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        load_config(str(bad))
    wrong_type = tmp_path / "wrong.toml"
    wrong_type.write_text("[train]\nsteps = 'many'\n")
    with pytest.raises(ConfigError, match="train.steps: expected an integer"):
        load_config(str(wrong_type))


def test_json_round_trip():
    cfg = apply_overrides(Config(), ["train.steps=70", "data.row_buckets=64,4096", "model.sparse.block_size=64"]).validate()
    assert config_from_json(cfg.to_json()) == cfg


def test_single_device_attention_under_a_planner_is_refused_at_start_up():
    """reference / jax attention have no ring version: with a planner (which may shard a
    sequence over a ring) they stop at start-up instead of silently running another kernel."""
    for attention in ("reference", "jax"):
        with pytest.raises(ConfigError, match=f"model.attention: '{attention}' has no sequence-parallel"):
            load_config("default", [f"model.attention={attention}"])
        assert load_config("default", [f"model.attention={attention}", "parallel.planner=none"]).model.attention == attention

