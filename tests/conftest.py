import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def bible_cache(tmp_path_factory):
    """A cache directory holding the embedded Bible corpus text (``bible/``), built once from
    the SWORD modules that scripts/setup_env.sh installs."""
    from aiayn.data.sources.bible import write_bible_corpus

    root = tmp_path_factory.mktemp("bible")
    write_bible_corpus(root / "bible")
    return root


@pytest.fixture(scope="session")
def reverse_data_dir(tmp_path_factory):
    """A prepared data directory (aiayn prepare) of the word-reversal task, built once."""
    from train_helpers import make_reverse_data

    return make_reverse_data(tmp_path_factory.mktemp("reverse"))
