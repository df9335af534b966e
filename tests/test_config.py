import pytest

from aiayn.config import ConfigError, load_config
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


def test_config_roundtrips_through_a_plain_dict():
    from aiayn.config import config_from_dict

    config = load_config(overrides=["preset=b_dk16", "model.dropout=0.2"])
    assert config_from_dict(config.to_dict()) == config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds(name):
    config = load_config(overrides=[f"preset={name}"])
    config.model.validate()
