"""train_run as a library call: the config it takes and what it refuses."""

import pytest

from aiayn.config import load_config
from aiayn.data.corpus import load_manifest
from aiayn.errors import ConfigError
from aiayn.training.launch import resolve_config, train_run
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
