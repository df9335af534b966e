"""train_run as a library call: the config it takes and what it refuses."""

import pytest

from aiayn.config import load_config
from aiayn.data.corpus import load_manifest
from aiayn.errors import ConfigError
from aiayn.training.launch import train_run
from aiayn.training.run_config import resolve_config
from tests.helpers import TINY


def test_train_run_refuses_a_config_that_does_not_fit_the_data(reverse_data_dir, tmp_path):
    vocab = int(load_manifest(reverse_data_dir)["vocab_size"])
    plain = load_config(TINY)  # the config file alone: not the data's vocabulary
    assert plain.model.vocab_size != vocab
    message = rf"model\.vocab_size={plain.model.vocab_size} but the tokenizer .*resolve_config,"
    with pytest.raises(ConfigError, match=message):
        train_run(plain, reverse_data_dir, tmp_path / "run", show_progress=False)
    assert not (tmp_path / "run").exists()
    assert resolve_config(TINY, reverse_data_dir).model.vocab_size == vocab


def test_resolve_config_reads_a_recipe_named_as_its_file(reverse_data_dir, monkeypatch):
    # The keys the recipe sets itself are what train.init_from keeps of it.
    from aiayn.recipes import FOLDER
    from aiayn.training import run_config

    read = []
    real = run_config._explicit_model_keys
    monkeypatch.setattr(
        run_config, "_explicit_model_keys", lambda p, o: read.append(p) or real(p, o)
    )
    by_name = resolve_config("multi30k", reverse_data_dir)
    assert read == [FOLDER / "multi30k.toml"]
    assert real(read[0], []) == {"dropout", "attention_dropout"}
    assert by_name == resolve_config(FOLDER / "multi30k.toml", reverse_data_dir)
