"""`TrainConfig`, its flat settings and its TOML file (`_config`, `_settings`,
`_config_file`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fusedpc.training import _config, _config_file, _settings


def test_defaults_validate_and_round_trip_through_toml(tmp_path):
    config = _config.TrainConfig()
    config.validate()
    odd = dataclasses.replace(config, text="my \"quoted\" text.txt", lr=2.5e-4, distributed=True,
                              model=dataclasses.replace(config.model, learn="attention,head"),
                              temperature=0.0)
    path = tmp_path / "config.toml"
    path.write_text(_config_file.config_to_toml(odd))
    assert _config_file.read_config_file(path) == _settings.config_settings(odd)
    assert _config_file.resolve_config(path) == odd


def test_the_example_configs_are_valid_and_default_toml_is_the_defaults():
    configs = Path(__file__).resolve().parents[2] / "configs"
    assert _config_file.resolve_config(configs / "default.toml") == _config.TrainConfig()
    tiny = _config_file.resolve_config(configs / "tiny.toml")
    model = tiny.model
    assert (model.width, model.n_heads, model.n_blocks, model.max_len, tiny.batch) == (
        16, 2, 1, 16, 4
    )


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nwidth = 32\nn_heads = 8\nlearn = ['feed_forward', 'head']\n"
                    "[optimiser]\nlr = 1\n")
    config = _config_file.resolve_config(path, {"n_heads": 4, "steps": 7})
    assert (config.model.width, config.model.n_heads, config.steps) == (32, 4, 7)
    assert config.model.learn == "feed_forward,head"
    assert config.lr == 1.0 and isinstance(config.lr, float)
    assert config.batch == _config.TrainConfig().batch


@pytest.mark.parametrize(
    "text, message",
    [
        ("width = 3\n", "must be inside the [model] section"),
        ("[modle]\nwidth = 3\n", "unknown section 'modle'"),
        ("[model]\nwidth = 'wide'\n", "width must be int"),
        ("[training]\nsteps = true\n", "steps must be int"),
        ("[model\n", "not valid TOML"),
        # Reliability III: a non-UTF-8 file was "'utf-8' codec can't decode ..." without name
        ("[model]\nname = '\u00e9'\n".encode("latin-1"), "is not UTF-8 text (byte 0xe9"),
    ],
)
def test_malformed_config_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match="c.toml") as info:
        _config_file.resolve_config(path)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"batch": 6, "devices": 4}, "batch=6 must divide over devices=4"),
        ({"learning_kind": "synaptic_uncertainty"}, "needs window >= 1"),
        ({"learning_kind": "telepathic"}, "learning_kind must be one of"),
        ({"validation_fraction": 1.0}, "validation_fraction"),
        ({"lr": -1.0}, "lr must be a positive number"),
        ({"tokenizer": "word"}, "tokenizer must be one of"),
    ],
)
def test_invalid_settings_are_refused(overrides, message):
    with pytest.raises(ValueError) as info:
        _config_file.resolve_config(None, overrides)
    assert message in str(info.value)


def test_resume_config_allows_only_settings_that_keep_the_run_identical(tmp_path):
    (tmp_path / "config.toml").write_text(_config_file.config_to_toml(_config.TrainConfig()))
    (tmp_path / "checkpoint.fpc").write_bytes(b"")
    config = _config_file.resume_config(tmp_path, {"steps": 5000, "eval_every": 50, "width": 64})
    assert config.steps == 5000 and config.eval_every == 50
    with pytest.raises(ValueError, match="cannot change lr, seed"):
        _config_file.resume_config(tmp_path, {"seed": 3, "lr": 0.1, "steps": 9})


def test_slot_lr_scales_parse_and_reject_bad_entries():
    config = _config.TrainConfig(slot_lr_scales="head=0.5, attention=2")
    assert config.lr_scales() == {"head": 0.5, "attention": 2.0}
    for bad in ("wings=2", "head=0", "head", "head=x"):
        with pytest.raises(ValueError, match="slot_lr_scales: expected entries slot=multiplier"):
            _config.TrainConfig(slot_lr_scales=bad).validate()
