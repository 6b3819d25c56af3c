"""The setting names of fusedpc 0.1 (`heads`, `blocks`, `seq` and the model's settings at
the top of `TrainConfig`) keep working for one release, with a `DeprecationWarning`."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from fusedpc.cli._parser import build_parser
from fusedpc.training import TrainConfig
from fusedpc.training._config import RENAMED, config_settings
from fusedpc.training._config_file import config_to_toml, resolve_config, resume_config
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


def test_old_keys_in_a_config_file_load_with_a_warning(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(OLD_TINY)
    with pytest.warns(DeprecationWarning, match="'heads' is now 'n_heads'"):
        old = resolve_config(path)
    assert old == resolve_config(_tiny())


def test_an_old_run_folder_resumes(tmp_path):
    config = resolve_config(_tiny())
    (tmp_path / "config.toml").write_text(old_config_toml(config))
    (tmp_path / "checkpoint.fpc").write_bytes(b"")
    with pytest.warns(DeprecationWarning, match="'seq' is now 'max_len'"):
        resumed = resume_config(tmp_path, {"steps": 60})
    assert resumed == dataclasses.replace(config, steps=60)
    with pytest.warns(DeprecationWarning):
        with pytest.raises(ValueError, match="cannot change n_heads"):
            resume_config(tmp_path, {"heads": 4, "steps": 60})


def test_old_and_new_name_of_one_setting_clash(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text("[model]\nheads = 2\nn_heads = 2\n")
    with pytest.raises(ValueError, match="'heads' and 'n_heads' name the same setting"):
        resolve_config(path)


def test_old_overrides_keywords_and_attributes_warn():
    with pytest.warns(DeprecationWarning, match="'blocks' is now 'n_blocks'"):
        config = resolve_config(None, {"blocks": 3, "width": 32})
    assert config.model.n_blocks == 3 and config.model.width == 32
    with pytest.warns(DeprecationWarning, match=r"TrainConfig\(width=, heads=, seq=\)"):
        old = TrainConfig(width=32, heads=8, seq=16, steps=5)
    assert old.model == GPTConfig(width=32, n_heads=8, max_len=16) and old.steps == 5
    for name, value in (("heads", 8), ("blocks", 2), ("seq", 16), ("width", 32),
                        ("learn", "all"), ("window", 0), ("head_kind", "gaussian")):
        with pytest.warns(DeprecationWarning, match=f"TrainConfig.{name} is now"):
            assert getattr(old, name) == value
    with pytest.warns(DeprecationWarning):
        synaptic = TrainConfig(learning_kind="synaptic_uncertainty", window=100)
    assert synaptic.model.learning_kwargs == {"window": 100}
    synaptic.validate()


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
