import re

import pytest

from aiayn.config import load_config
from aiayn.errors import ConfigError
from aiayn.presets import PRESETS


def test_defaults_are_the_papers_base_model():
    config = load_config()
    m, t, d = config.model, config.train, config.decode
    assert (m.d_model, m.d_ff, m.n_heads, m.n_layers) == (512, 2048, 8, 6)
    assert (m.head_dim_k, m.head_dim_v) == (64, 64)
    assert m.dropout == 0.1 and not m.pre_norm and m.share_embeddings
    assert m.positional == "sinusoidal"
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps) == (0.9, 0.98, 1e-9)
    assert t.warmup_steps == 4000 and t.label_smoothing == 0.1
    assert (d.beam_size, d.alpha, d.max_len_a, d.max_len_b) == (4, 0.6, 1.0, 50)


def test_overrides_are_typed():
    config = load_config(overrides=["model.dropout=0.3", "train.max_steps=10", "preset=big"])
    assert config.model.dropout == 0.3
    assert config.train.max_steps == 10
    assert config.model.d_model == 1024


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ConfigError, match=r"model\.dropuot.*valid keys.*dropout"):
        load_config(overrides=["model.dropuot=0.3"])


def test_bad_value_type_is_an_error():
    with pytest.raises(ConfigError, match=r"train\.max_steps must be an integer"):
        load_config(overrides=["train.max_steps=ten"])
    with pytest.raises(ConfigError, match="positional must be one of"):
        load_config(overrides=["model.positional=rotary"])


def test_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "tiny"\n[model]\ndropout = 0.2\n[train]\nmax_steps = 7\n')
    config = load_config(path, ["train.max_steps=9"])
    assert config.preset == "tiny"
    assert config.model.d_model == 32 and config.model.dropout == 0.2
    assert config.train.max_steps == 9


def test_a_files_own_errors_name_the_file(tmp_path):
    """A value the file gets wrong is reported with the file's name; one an override gets
    wrong (the file alone is fine) without it."""
    path = tmp_path / "run.toml"
    path.write_text('[train]\nmax_steps = "many"\n')
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: train\.max_steps must be an integer"
    ):
        load_config(path)
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: train\.max_steps must be an integer"
    ):
        load_config(path, ["model.dropout=0.2"])
    assert load_config(path, ["train.max_steps=3"]).train.max_steps == 3  # overridden: fine
    path.write_text("[model]\nd_model = 30\n")
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: model\.d_model=30 is not divisible"
    ):
        load_config(path)
    path.write_text("[train]\nmax_steps = 5\n")
    with pytest.raises(ConfigError, match=r"^model\.dropout"):
        load_config(path, ["model.dropout=2"])
    # A section that is no table: said so, named, with or without overrides.
    path.write_text('model = 5\n[train]\nmax_steps = "many"\n')
    with pytest.raises(ConfigError, match=r"model must be a table \(\[model\]\), got 5"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"train\.max_steps must be an integer"):
        load_config(path, ["model.vocab_size=8000"])


def test_config_roundtrips_through_a_plain_dict():
    from aiayn.config import config_from_dict

    config = load_config(overrides=["preset=b_dk16", "model.dropout=0.2"])
    assert config_from_dict(config.to_dict()) == config


def test_config_roundtrips_through_toml(tmp_path):
    # What a run writes to its config.toml: None as "none", booleans, floats, strings.
    from aiayn.config import config_to_toml

    config = load_config(
        overrides=["preset=b_dk16", "model.dropout=0.2", "train.init_from=runs/x", "data.max_len=7"]
    )
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(config), encoding="utf-8")
    assert load_config(path) == config
    assert 'preset = "b_dk16"' in path.read_text() and 'tgt_vocab_size = "none"' in path.read_text()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds(name):
    config = load_config(overrides=[f"preset={name}"])
    config.model.validate()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.n_heads=0", r"model\.n_heads must be positive, got 0"),
        ("model.d_k=0", r"model\.d_k must be positive, got 0"),
        ("model.dropout=1.0", r"model\.dropout must be in \[0, 1\)"),
        ("data.max_tokens=0", r"data\.max_tokens must be positive"),
        ("train.warmup_steps=0", r"train\.warmup_steps must be positive, got 0"),
        ("train.warmup_steps=-1", r"train\.warmup_steps must be positive, got -1"),
        ("train.label_smoothing=1.5", r"train\.label_smoothing must be in \[0, 1\)"),
        ("train.adam_beta1=1.5", r"train\.adam_beta1 must be in \[0, 1\)"),
        ("train.lr_scale=-1", r"train\.lr_scale must be 0 or more"),
        ("train.max_steps=-5", r"train\.max_steps must be 0 or more, got -5"),
        ("train.keep_last=-1", r"train\.keep_last must be 0 or more"),
        ("decode.beam_size=0", r"decode\.beam_size must be positive, got 0"),
        ("decode.alpha=-0.6", r"decode\.alpha must be a number from 0 to 10, got -0\.6"),
        ("decode.alpha=inf", r"decode\.alpha must be a number from 0 to 10, got inf"),
        ("decode.alpha=400", r"decode\.alpha must be a number from 0 to 10, got 400\.0"),
        ("decode.batch_tokens=0", r"decode\.batch_tokens must be positive"),
    ],
)
def test_values_out_of_range_are_refused_when_read(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_patience_without_validation_is_refused():
    with pytest.raises(ConfigError, match=r"train\.patience=3 counts validations, and train\.v"):
        load_config(overrides=["train.patience=3", "train.valid_interval=0"])


def test_the_time_fitted_schedule_and_average_say_what_they_need():
    time_schedule = "train.lr_schedule=linear_time"
    needs = r'train\.lr_schedule = "linear_time" decays to zero at train\.max_minutes: set train\.'
    for minutes in ("0", "inf"):
        with pytest.raises(ConfigError, match=needs + rf"max_minutes .*, got {minutes}$"):
            load_config(overrides=[time_schedule, f"train.max_minutes={minutes}"])
    # With the time, no update count is needed: max_steps = 0 is no cap.
    config = load_config(overrides=[time_schedule, "train.max_minutes=60", "train.max_steps=0"])
    assert config.train.max_steps == 0 and config.train.lr_schedule == "linear_time"
    with pytest.raises(ConfigError, match=r"train\.average_from=0\.5 counts the progress of a sch"):
        load_config(overrides=["train.average_from=0.5"])  # Eq. 3 has no end
    for value in ("1", "-0.1"):
        with pytest.raises(ConfigError, match=r"train\.average_from must be in \[0, 1\)"):
            load_config(
                overrides=[time_schedule, "train.max_minutes=60", f"train.average_from={value}"]
            )
    by_steps = load_config(overrides=["train.lr_schedule=linear", "train.average_from=0.67"])
    assert by_steps.train.average_from == 0.67


def test_zero_means_off_where_documented():
    zeros = ["train.max_steps=0", "train.valid_interval=0", "train.clip_norm=0"]
    zeros += ["train.patience=0", "train.average_last=0", "train.lr_scale=0", "decode.alpha=0"]
    zeros += ["train.log_interval=0", "train.max_bad_steps=0", "decode.max_len_b=0"]
    config = load_config(overrides=[*zeros, "train.max_minutes=5"])
    assert config.train.valid_interval == 0 and config.decode.alpha == 0


def test_unreadable_config_files(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'preset = "tiny"\xff\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: not UTF-8"):
        load_config(bad)
    # A byte order mark (some Windows editors write one) is skipped.
    marked = tmp_path / "marked.toml"
    marked.write_bytes(b'\xef\xbb\xbfpreset = "tiny"\n[train]\nmax_steps = 7\n')
    assert load_config(marked).train.max_steps == 7


def test_a_stored_config_is_checked_for_its_model_only():
    """A checkpoint's config is what its run used: an older aiayn may have accepted values
    that this one refuses, and the model must still load; its [model] must build."""
    from aiayn.config import config_from_dict

    raw = load_config(overrides=["preset=tiny"]).to_dict()
    raw["train"]["warmup_steps"] = 0
    assert config_from_dict(raw, stored=True).train.warmup_steps == 0
    with pytest.raises(ConfigError, match="warmup_steps"):
        config_from_dict(raw)
    raw["model"]["n_heads"] = 0
    with pytest.raises(ConfigError, match="n_heads"):
        config_from_dict(raw, stored=True)


def test_table3_rows_are_scored_without_averaging_and_base_big_with_it():
    # §6.1: base averages the last 5 checkpoints, big the last 20; §6.2 scores the
    # variations of Table 3 (rows A to E) "with no checkpoint averaging".
    from aiayn.presets import TABLE3_ROWS

    assert load_config(None, ["preset=base"]).train.average_last == 5
    assert load_config(None, ["preset=big"]).train.average_last == 20
    variations = [row for row in TABLE3_ROWS if row not in ("base", "big")]
    assert variations and all(row[0] in "abcde" for row in variations)
    for row in variations:
        assert load_config(None, [f"preset={row}"]).train.average_last == 0, row


def test_activation_checkpointing_is_refused_for_the_rnn_baselines():
    for preset in ("rnnsearch", "luong"):
        with pytest.raises(ConfigError, match=r"model\.arch=\w+ has none: set it to false"):
            load_config(overrides=[f"preset={preset}", "train.activation_checkpointing=true"])
    assert load_config(overrides=["preset=tiny", "train.activation_checkpointing=true"])


def test_numpy_numbers_are_taken_as_pythons():
    import numpy as np

    from aiayn.config import config_from_dict

    raw = {"decode": {"beam_size": np.int64(5), "alpha": np.float32(0.5)}}
    config = config_from_dict({**raw, "train": {"compile": np.True_}})
    assert type(config.decode.beam_size) is int and config.decode.beam_size == 5
    assert type(config.decode.alpha) is float and config.train.compile is True
    for bad in (float("inf"), 2.5, True):
        with pytest.raises(ConfigError, match=r"decode\.beam_size must be an integer"):
            config_from_dict({"decode": {"beam_size": bad}})


def test_load_config_takes_a_shipped_recipe_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    assert load_config("tiny").preset == "tiny"
    assert load_config("multi30k.toml", ["train.max_steps=7"]).train.max_steps == 7
    with pytest.raises(
        ConfigError, match=r"nonesuch does not exist, nor .*\(base, bible_classify, "
    ):
        load_config("nonesuch")
    with pytest.raises(ConfigError, match=r"config file sub/nonesuch\.toml does not exist$"):
        load_config("sub/nonesuch.toml")
