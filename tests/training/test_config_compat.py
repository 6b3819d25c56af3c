"""The setting names of fusedpc 0.1 (`heads`, `blocks`, `seq` and the model's settings at
the top of `TrainConfig`), deprecated in 0.2, were removed in 0.4.0: each is refused with a
message that names it (and, for a flat setting, its new name)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from fusedpc.cli._parser import build_parser
from fusedpc.training import TrainConfig, resolve_config, resume_config
from fusedpc.training._config_file import config_to_toml
from fusedpc.training._settings import RENAMED, config_settings
from fusedpc.training._start_point import _changed_settings
from fusedpc.transformer import GPTConfig

# configs/tiny.toml as fusedpc 0.1 shipped it.
OLD_TINY = """
[model]
width = 16
heads = 2
blocks = 1
ff_width = 64
seq = 16

[training]
steps = 30
batch = 4
steps_per_call = 5
eval_every = 10
eval_batches = 2
report_every = 2
sample_tokens = 40
"""


def _tiny() -> Path:
    return Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def old_config_toml(config: TrainConfig) -> str:
    """`config.toml` as fusedpc 0.1 wrote it: the 0.1 names, no newer model keys."""
    lines = []
    for line in config_to_toml(config).splitlines():
        key = line.split(" = ")[0]
        if key in ("fused_qkv", "hidden_precision", "scan"):
            continue
        for old, new in RENAMED.items():
            if key == new:
                line = line.replace(new, old, 1)
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_the_model_part_is_a_gpt_config_with_gpt_config_names():
    config = TrainConfig()
    assert isinstance(config.model, GPTConfig)
    assert config.gpt_config(65) == GPTConfig(vocab_size=65)
    assert dataclasses.replace(config.model, vocab_size=7) == config.gpt_config(7)
    settings = config_settings(config)
    assert (settings["n_heads"], settings["n_blocks"], settings["max_len"]) == (4, 2, 64)
    assert not set(RENAMED) & set(settings)


def test_old_keys_in_a_config_file_are_refused_naming_the_new_names(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(OLD_TINY)
    with pytest.raises(ValueError, match="'heads' is now 'n_heads'") as caught:
        resolve_config(path)
    message = str(caught.value)
    assert str(path) in message
    assert "'blocks' is now 'n_blocks'" in message and "'seq' is now 'max_len'" in message
    assert "the old names were removed in 0.4.0" in message


def test_an_old_run_folder_is_refused(tmp_path):
    (tmp_path / "config.toml").write_text(old_config_toml(resolve_config(_tiny())))
    (tmp_path / "checkpoint.fpc").write_bytes(b"")
    with pytest.raises(ValueError, match="'seq' is now 'max_len'"):
        resume_config(tmp_path, {"steps": 60})


def test_an_old_checkpoints_config_is_refused():
    # a checkpoint of fusedpc 0.1 records its config in the old names too
    saved = {**config_settings(TrainConfig()), "heads": 4}
    del saved["n_heads"]
    with pytest.raises(ValueError, match="the checkpoint's config: .*'heads' is now 'n_heads'"):
        _changed_settings(saved, TrainConfig())


def test_old_and_new_name_of_one_setting_are_refused_as_the_old_name(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text("[model]\nheads = 2\nn_heads = 2\n")
    with pytest.raises(ValueError, match="'heads' is now 'n_heads'"):
        resolve_config(path)


def test_old_overrides_are_refused_naming_the_new_names(tmp_path):
    with pytest.raises(ValueError, match="settings: .*'blocks' is now 'n_blocks'"):
        resolve_config(None, {"blocks": 3, "width": 32})
    (tmp_path / "config.toml").write_text(config_to_toml(resolve_config(_tiny())))
    (tmp_path / "checkpoint.fpc").write_bytes(b"")
    with pytest.raises(ValueError, match="settings: .*'heads' is now 'n_heads'"):
        resume_config(tmp_path, {"heads": 4, "steps": 60})


@pytest.mark.parametrize("name, value", [
    ("width", 32), ("heads", 8), ("blocks", 2), ("seq", 16), ("ff_width", 64),
    ("learn", "all"), ("learning_kind", "synaptic_uncertainty"), ("window", 100),
    ("head_kind", "gaussian"),
])
def test_old_keywords_and_attributes_are_refused(name, value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not forwarded with a warning
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            TrainConfig(**{name: value})
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
            getattr(TrainConfig(), name)
    assert name not in dir(TrainConfig)


def test_new_code_raises_no_deprecation_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        config = resolve_config(_tiny(), {"n_heads": 4, "max_len": 8})
        path = tmp_path / "config.toml"
        path.write_text(config_to_toml(config))
        assert resolve_config(path) == config
        dataclasses.replace(config, steps=3)


@pytest.mark.parametrize(
    "old, new", [("--heads", "n_heads"), ("--blocks", "n_blocks"), ("--seq", "max_len")]
)
def test_old_cli_flags_are_aliases(old, new):
    train = build_parser().commands["train"]
    args = train.parse_args([old, "8"])
    assert getattr(args, new) == 8


def test_model_flags_of_gpt_config_parse():
    train = build_parser().commands["train"]
    args = train.parse_args(["--fused-qkv", "true", "--scan", "false", "--hidden-precision", "2"])
    assert (args.fused_qkv, args.scan, args.hidden_precision) == (True, False, 2.0)
    assert train.parse_args(["--scan", "auto"]).scan == "auto"
    config = resolve_config(None, {"fused_qkv": True, "scan": False, "hidden_precision": 2.0})
    assert (config.model.fused_qkv, config.model.scan, config.model.hidden_precision) == (
        True, False, 2.0
    )
    with pytest.raises(ValueError, match="scan must be true, false or 'auto', got 'always'"):
        resolve_config(None, {"scan": "always"})
