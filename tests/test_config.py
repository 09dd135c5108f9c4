"""Config loading: inheritance, overrides, typed conversion and every error path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from spade_mega.config import ConfigError, SpadeConfig, load_config, load_raw, prepare_run_dir, to_dict

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def error_of(*args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_config_loads_and_validates(name: str) -> None:
    cfg = load_config(EXAMPLES / name)
    assert isinstance(cfg, SpadeConfig)


def test_reference_recipe_values() -> None:
    cfg = load_config(EXAMPLES / "qwen3_30b_a3b_games.yaml")
    assert (cfg.parallel.tensor, cfg.parallel.sequence_parallel, cfg.parallel.expert) == (4, True, 8)
    assert (cfg.model.num_experts, cfg.model.moe_router_topk, cfg.model.moe_ffn_hidden_size) == (128, 8, 768)
    assert (cfg.rollout.temperature, cfg.rollout.hint_temperature, cfg.rollout.max_turns) == (0.6, 0.3, 25)
    assert (cfg.selfplay.regen_interval, cfg.selfplay.designer_delay, cfg.optimizer.lr) == (4, 4, 1e-6)


def test_base_inheritance_merges_sections_and_nearest_file_wins() -> None:
    games = load_config(EXAMPLES / "qwen3_30b_a3b_games.yaml")
    tool = load_config(EXAMPLES / "qwen3_30b_a3b_tool_use.yaml")
    assert (tool.selfplay.regen_interval, tool.selfplay.designer_delay) == (8, 8)
    assert tool.run.name == "qwen3_30b_a3b_tool_use"
    assert tool.selfplay.num_rollouts == games.selfplay.num_rollouts  # inherited, untouched keys kept
    assert tool.model == games.model


def test_multi_level_and_list_bases(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "model: {num_layers: 4, hidden_size: 128}\nrun: {seed: 1}\n")
    write(tmp_path / "b.yaml", "model: {hidden_size: 96}\n")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "c.yaml", "base: [../a.yaml, ../b.yaml]\nrun: {seed: 7}\n")
    write(tmp_path / "d.yaml", "base: sub/c.yaml\nmodel: {num_layers: 6}\n")
    cfg = load_config(tmp_path / "d.yaml")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.run.seed) == (6, 96, 7)


def test_inheritance_cycle_is_an_error(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    err = error_of(tmp_path / "a.yaml")
    assert "cycle" in err.message and "a.yaml -> b.yaml -> a.yaml" in err.message


def test_overrides_parse_as_yaml_and_apply_in_order(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLES / "tiny_cpu.yaml", [
        "model.num_layers=3", "rollout.temperature=0.9", "model.tokenizer=null", "run.name=x",
        "parallel={tensor: 2, sequence_parallel: true}", "model.num_query_groups=4", "run.name=final",
    ])
    assert cfg.model.num_layers == 3 and cfg.rollout.temperature == 0.9 and cfg.model.tokenizer is None
    assert (cfg.parallel.tensor, cfg.parallel.sequence_parallel, cfg.parallel.expert) == (2, True, 1)
    assert cfg.run.name == "final"


def test_int_is_accepted_for_float_and_numeric_text_too() -> None:
    cfg = load_config(None, ["optimizer.lr=1", "optimizer.min_lr=1e-7"])  # YAML 1.1 reads 1e-7 as a string
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float) and cfg.optimizer.min_lr == 1e-7


def test_defaults_without_a_file_are_valid() -> None:
    assert load_config() == SpadeConfig()


def test_typo_in_override_suggests_the_key() -> None:
    err = error_of(EXAMPLES / "tiny_cpu.yaml", ["rollout.temprature=1"])
    assert err.path == "rollout.temprature"
    assert "did you mean 'temperature'" in str(err)


def test_typo_in_file_section_names_full_path(tmp_path: Path) -> None:
    err = error_of(write(tmp_path / "c.yaml", "optimiser:\n  lr: 1\n"))
    assert err.path == "optimiser" and "did you mean 'optimizer'" in str(err)


def test_unknown_key_without_close_match_lists_known_keys() -> None:
    err = error_of(None, ["run.zzzzzz=1"])
    assert "known keys: name, output_dir, seed, resume" in str(err)


@pytest.mark.parametrize("override, path, expected", [
    ("model.num_layers=three", "model.num_layers", "expected int, got str 'three'"),
    ("model.num_layers=2.5", "model.num_layers", "expected int, got float 2.5"),
    ("model.num_layers=true", "model.num_layers", "expected int, got bool True"),
    ("model.qk_layernorm=1", "model.qk_layernorm", "expected bool (true/false), got int 1"),
    ("rollout.temperature=hot", "rollout.temperature", "expected float, got str 'hot'"),
    ("rollout.temperature=.inf", "rollout.temperature", "expected a finite float"),
    ("model.name=[a]", "model.name", "expected str, got list"),
    ("model.hf_config=3", "model.hf_config", "expected str or null, got int 3"),
    ("parallel.recompute=ful", "parallel.recompute", "expected one of 'none', 'selective', 'full'"),
    ("parallel=4", "parallel", "expected a mapping (section), got int 4"),
])
def test_wrong_type_names_path_and_expected_type(override: str, path: str, expected: str) -> None:
    err = error_of(None, [override])
    assert err.path == path
    assert expected in err.message


def test_literal_suggests_close_choice() -> None:
    assert "did you mean 'full'" in str(error_of(None, ["parallel.recompute=ful"]))


@pytest.mark.parametrize("overrides, path", [
    (["model.num_layers=0"], "model.num_layers"),
    (["model.num_query_groups=3"], "model.num_query_groups"),
    (["model.moe_router_topk=8"], "model.moe_router_topk"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (["parallel.virtual_pipeline=2"], "parallel.virtual_pipeline"),
    (["optimizer.min_lr=1"], "optimizer.min_lr"),
    (["optimizer.adam_beta2=1.0"], "optimizer.adam_beta2"),
    (["rollout.top_p=0"], "rollout.top_p"),
    (["rollout.max_response_tokens=99999"], "rollout.max_response_tokens"),
    (["curriculum.active_skills=7"], "curriculum.active_skills"),
    (["run.name=a/b"], "run.name"),
    (["logging.log_interval=0"], "logging.log_interval"),
    (["parallel.tensor=3"], "parallel.tensor"),
    (["parallel.pipeline=3"], "parallel.pipeline"),
    (["parallel.expert=3"], "parallel.expert"),
    (["parallel.expert=2", "model.num_experts=0"], "parallel.expert"),
    (["parallel.tensor=2"], "parallel.sequence_parallel"),  # MoE + TP needs SP
])
def test_value_constraints_name_the_key(overrides: list[str], path: str) -> None:
    assert error_of(None, overrides).path == path


@pytest.mark.parametrize("override", ["novalue", "=3", "a..b=1"])
def test_malformed_override(override: str) -> None:
    with pytest.raises(ConfigError):
        load_config(None, [override])


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    err = error_of(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(err) and "not found" in str(err)


def test_missing_base_names_the_base_file(tmp_path: Path) -> None:
    err = error_of(write(tmp_path / "c.yaml", "base: gone.yaml\n"))
    assert "gone.yaml" in err.path and "not found" in err.message


def test_directory_instead_of_file(tmp_path: Path) -> None:
    assert "not a regular file" in str(error_of(tmp_path))


def test_invalid_yaml_gives_line(tmp_path: Path) -> None:
    err = error_of(write(tmp_path / "bad.yaml", "model:\n  num_layers: [1, 2\n"))
    assert "invalid YAML" in err.message and "line" in err.message


def test_top_level_must_be_mapping(tmp_path: Path) -> None:
    assert "must be a mapping" in str(error_of(write(tmp_path / "l.yaml", "- 1\n- 2\n")))


def test_bad_base_value(tmp_path: Path) -> None:
    assert "base" in error_of(write(tmp_path / "b.yaml", "base: 3\n")).path


def test_empty_file_is_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path / "empty.yaml", "")) == SpadeConfig()


def test_resolved_config_saved_in_run_dir_round_trips(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLES / "qwen3_30b_a3b_tool_use.yaml", [f"run.output_dir={tmp_path}", "run.name=r1"])
    run_dir = prepare_run_dir(cfg)
    saved = run_dir / "config.yaml"
    assert run_dir == tmp_path / "r1" and saved.is_file()
    assert "base" not in yaml.safe_load(saved.read_text())  # fully resolved, no inheritance left
    assert load_config(saved) == cfg
    assert to_dict(cfg) == load_raw(saved)
