import errno
import os
import stat
from pathlib import Path

import pytest
import torch

from aiayn.inference import loading
from aiayn.model.transformer import Transformer
from aiayn.training import averaging
from aiayn.training import checkpoint as ckpt
from tests.helpers import make_reverse_data, small_reverse_trainer, tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")


def _model_file(path, config, seed, tokenizer=b"tok", step=1):
    torch.manual_seed(seed)
    model = Transformer(config.model)
    state = ckpt.model_checkpoint(
        config, ckpt.model_state(model), ckpt.bytes_to_tensor(tokenizer), step, 0
    )
    ckpt.save_atomic(state, path)
    return model


def test_atomic_save_leaves_no_temporary_and_loads_weights_only(tmp_path):
    config = tiny_config()
    path = tmp_path / "checkpoints" / "step_00000001.pt"
    model = _model_file(path, config, seed=0)
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    state = torch.load(path, weights_only=True)  # no pickled objects anywhere
    assert state["format"] == loading.CHECKPOINT_FORMAT and state["config"] == config.to_dict()
    # The shared embedding is stored once: its three names share one storage.
    ptrs = {
        state["model"][k].untyped_storage().data_ptr()
        for k in ("src_embed.token.weight", "tgt_embed.token.weight", "out_proj.weight")
    }
    assert len(ptrs) == 1
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value)


def test_truncated_checkpoint_is_reported_and_resume_falls_back(tmp_path, capsys):
    config = tiny_config("train.max_steps=4", "train.save_interval_steps=2")
    small_reverse_trainer(config, tmp_path).train()
    newest = loading.step_checkpoint_path(tmp_path, 4)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with pytest.raises(loading.CheckpointError, match=r"step_00000004\.pt is unreadable"):
        loading.load_checkpoint(newest)
    capsys.readouterr()
    path, state = loading.latest_valid_checkpoint(tmp_path)
    assert path == loading.step_checkpoint_path(tmp_path, 2) and state["step"] == 2
    assert "step_00000004.pt is unreadable" in capsys.readouterr().err
    # Averaging passes over it too, and says so.
    averaged = loading.load_checkpoint(averaging.average_run(tmp_path, 1))
    assert averaged["step"] == 2 and averaged["metrics"]["averaged"] == 1.0
    assert "left out of the average" in capsys.readouterr().err
    # Garbage and foreign files are refused too, saying what they are.
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(loading.CheckpointError, match=r"junk\.pt is not an aiayn checkpoint \(not"):
        loading.load_checkpoint(tmp_path / "junk.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(loading.CheckpointError, match=r"empty\.pt is empty"):
        loading.load_checkpoint(tmp_path / "empty.pt")
    torch.save({"a": torch.zeros(1)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(loading.CheckpointError, match=r"legacy\.pt is not an aiayn .*: a pickle"):
        loading.load_checkpoint(tmp_path / "legacy.pt")
    torch.save({"a": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(loading.CheckpointError, match="not an aiayn checkpoint"):
        loading.load_checkpoint(tmp_path / "other.pt")
    # A pickled module is refused without running it, and without pointing at unsafe loading.
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")
    for mmap in (False, True):  # read, or mapped as inference loads: judged alike
        with pytest.raises(loading.CheckpointError, match="holds Python objects") as refused:
            loading.load_checkpoint(tmp_path / "module.pt", mmap=mmap)
        assert "weights_only" not in str(refused.value)
        with pytest.raises(loading.CheckpointError, match="not an aiayn checkpoint"):
            loading.load_checkpoint(tmp_path / "other.pt", mmap=mmap)


def test_averaging_identity_and_mean(tmp_path):
    config = tiny_config()
    a = _model_file(tmp_path / "a.pt", config, seed=1)
    b = _model_file(tmp_path / "b.pt", config, seed=2)
    same = averaging.average_checkpoints([tmp_path / "a.pt"] * 3)
    for key, value in a.state_dict().items():
        torch.testing.assert_close(same[key], value, rtol=0, atol=1e-7)
    mean = averaging.average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])
    b_state = b.state_dict()
    for key, value in a.state_dict().items():
        torch.testing.assert_close(
            mean[key], (value.double() + b_state[key].double()).div(2).float()
        )
        assert mean[key].dtype == torch.float32
    tied = [
        mean[k] for k in ("src_embed.token.weight", "tgt_embed.token.weight", "out_proj.weight")
    ]
    assert tied[0] is tied[1] is tied[2]
    # The result loads into a model whose weights stay tied.
    model = Transformer(config.model)
    model.load_state_dict(mean)
    assert model.out_proj.weight is model.src_embed.token.weight


def test_averaging_refuses_different_shapes(tmp_path):
    _model_file(tmp_path / "a.pt", tiny_config(), seed=1)
    _model_file(tmp_path / "b.pt", tiny_config("model.d_ff=128"), seed=1)
    with pytest.raises(loading.CheckpointError, match=r"model configs differ \(d_ff\)"):
        averaging.average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])
    _model_file(tmp_path / "c.pt", tiny_config("model.n_layers=1"), seed=1)
    with pytest.raises(loading.CheckpointError, match=r"model configs differ \(n_layers\)"):
        averaging.average_checkpoints([tmp_path / "a.pt", tmp_path / "c.pt"])
    # Weights alone (no config to compare): their names and shapes are checked.
    total = averaging._ModelSum()
    total.add(torch.load(tmp_path / "a.pt", weights_only=True)["model"], tmp_path / "a.pt")
    with pytest.raises(loading.CheckpointError, match=r"w1\.weight has shape"):
        total.add(torch.load(tmp_path / "b.pt", weights_only=True)["model"], tmp_path / "b.pt")


def test_averaging_refuses_other_tokenizers_and_model_configs(tmp_path):
    """Same shapes, different vocabularies (or configs): averaging them would be garbage."""
    _model_file(tmp_path / "a.pt", tiny_config(), seed=1, tokenizer=b"vocabulary one")
    _model_file(tmp_path / "b.pt", tiny_config(), seed=2, tokenizer=b"vocabulary two")
    with pytest.raises(loading.CheckpointError, match="different tokenizers"):
        averaging.average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])
    _model_file(
        tmp_path / "c.pt", tiny_config("model.dropout=0.3"), seed=3, tokenizer=b"vocabulary one"
    )
    with pytest.raises(loading.CheckpointError, match=r"model configs differ \(dropout\)"):
        averaging.average_checkpoints([tmp_path / "a.pt", tmp_path / "c.pt"])
    _model_file(tmp_path / "d.pt", tiny_config(), seed=4, tokenizer=b"vocabulary one")
    averaging.average_checkpoints([tmp_path / "a.pt", tmp_path / "d.pt"])  # the same: fine


def test_load_for_inference_from_file_and_run_dir(tmp_path):
    from aiayn.data.corpus import tokenizer_path

    data = make_reverse_data(tmp_path / "text", n_train=200, n_valid=10)
    spm = tokenizer_path(data).read_bytes()
    config = tiny_config("model.vocab_size=13")
    run = tmp_path / "run"
    for step, seed in ((1, 1), (2, 2)):
        _model_file(loading.step_checkpoint_path(run, step), config, seed, spm, step)
    model, loaded_config, tokenizer = loading.load_for_inference(run)  # newest: step 2
    torch.manual_seed(2)
    expected = Transformer(config.model)
    assert not model.training and loaded_config == config
    assert torch.equal(model.out_proj.weight, expected.out_proj.weight)
    assert model.out_proj.weight is model.tgt_embed.token.weight
    assert tokenizer.decode(tokenizer.encode("alpha bravo")) == "alpha bravo"
    # averaged.pt wins when present.
    averaging.average_run(run, 2)
    model, _, _ = loading.load_for_inference(run)
    assert loading.resolve_checkpoint(run).name == "averaged.pt"
    # The run's checkpoints folder: its newest step checkpoint, not the average beside it.
    folder = run / loading.CHECKPOINT_DIR
    assert loading.resolve_checkpoint(folder).name == "step_00000002.pt"
    empty = tmp_path / "other" / loading.CHECKPOINT_DIR
    empty.mkdir(parents=True)
    with pytest.raises(loading.CheckpointError, match="holds no readable step checkpoint"):
        loading.resolve_checkpoint(empty)
    with pytest.raises(loading.CheckpointError, match="does not exist"):
        loading.load_for_inference(tmp_path / "nothing.pt")


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=oct)
def test_atomic_save_gets_the_permissions_of_a_plain_open(tmp_path, umask):
    # mkstemp's 0600 would hide checkpoints from the other users whatever the umask.
    previous = os.umask(umask)
    try:
        (tmp_path / "plain").write_bytes(b"")
        _model_file(tmp_path / "best.pt", tiny_config(), seed=0)
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "best.pt").stat().st_mode)
    assert mode == 0o666 & ~umask == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "plain"]


def _train_and_truncate(run_dir, config):
    """Train ``config``, then truncate its newest step checkpoint as a crash or a full disk
    would; returns (a trainer resumed as the CLI does, the truncated file)."""

    def trainer(config):
        return small_reverse_trainer(config, run_dir)

    trainer(config).train()
    newest = loading.list_step_checkpoints(run_dir)[-1]
    newest.write_bytes(newest.read_bytes()[:1000])
    return trainer, newest


def test_corrupt_newer_checkpoints_are_set_aside_when_a_run_resumes(tmp_path, capsys):
    over = ["train.save_interval_steps=2", "train.keep_last=2"]
    make, broken = _train_and_truncate(tmp_path, tiny_config("train.max_steps=6", *over))
    assert broken.name == "step_00000006.pt"
    # A newer checkpoint that fails for another reason (here: a newer format) stays put.
    state = loading.load_checkpoint(loading.step_checkpoint_path(tmp_path, 4))
    newer = loading.step_checkpoint_path(tmp_path, 8)
    ckpt.save_atomic({**state, "format_version": loading.CHECKPOINT_VERSION + 1}, newer)
    capsys.readouterr()
    path, state = ckpt.resume_point(tmp_path)  # what train_run resumes from
    assert path.name == "step_00000004.pt"
    assert "set step_00000006.pt aside as step_00000006.pt.broken" in capsys.readouterr().err
    assert (tmp_path / loading.CHECKPOINT_DIR / "step_00000006.pt.broken").is_file()
    newer.unlink()
    resumed = make(tiny_config("train.max_steps=5", *over))
    resumed.load_state_dict(state)
    resumed.train()
    # The corrupt step 6 (the continuation that died) does not push out step 4.
    names = [p.name for p in loading.list_step_checkpoints(tmp_path)]
    assert names == ["step_00000004.pt", "step_00000005.pt"]
    capsys.readouterr()
    averaged = loading.load_checkpoint(averaging.average_run(tmp_path, 2))
    assert averaged["metrics"]["averaged"] == 2.0
    assert capsys.readouterr().err == ""  # no warning about a broken or missing file


def test_a_readable_checkpoint_is_never_set_aside(tmp_path):
    """Only corrupt files move: a fresh Trainer in a run directory keeps its checkpoints."""
    over = ["train.save_interval_steps=1", "train.keep_last=3"]
    make, _ = _train_and_truncate(tmp_path, tiny_config("train.max_steps=3", *over))
    make(tiny_config("train.max_steps=1", *over)).train()  # from scratch, by the Python API
    assert [p.name for p in loading.list_step_checkpoints(tmp_path)][:2] == [
        "step_00000001.pt",
        "step_00000002.pt",
    ]


def test_a_checkpoint_that_cannot_be_read_now_is_not_called_corrupt(tmp_path, monkeypatch):
    """An I/O error (a network filesystem's EIO) is about the file, not its bytes: a
    CheckpointError naming it, not CheckpointCorrupt, so resume leaves the file where it is."""
    config = tiny_config("train.max_steps=2", "train.save_interval_steps=1")
    small_reverse_trainer(config, tmp_path).train()

    def failing_load(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(torch, "load", failing_load)
    newest = loading.step_checkpoint_path(tmp_path, 2)
    with pytest.raises(loading.CheckpointError, match="cannot be read: Input/output error") as err:
        loading.load_checkpoint(newest)
    assert not isinstance(err.value, loading.CheckpointCorrupt)
    assert ckpt.resume_point(tmp_path) is None
    assert newest.is_file()


def test_a_checkpoint_cut_anywhere_is_corrupt_and_set_aside(tmp_path, capsys, monkeypatch):
    """Cut at any length, a checkpoint is CheckpointCorrupt, read or mapped (PyTorch's zip
    reader raises EINVAL for some lengths, a RuntimeError for others), and resume sets it
    aside; the message is one sentence, without the zip reader's paragraph."""
    config = tiny_config("train.max_steps=2", "train.save_interval_steps=1")
    small_reverse_trainer(config, tmp_path).train()
    newest = loading.step_checkpoint_path(tmp_path, 2)
    data = newest.read_bytes()
    short = tmp_path / "short.pt"
    for fraction in (0.002, 0.01, 0.05, 0.1, 0.25, 0.5, 0.9):
        short.write_bytes(data[: int(len(data) * fraction)])
        for mmap in (False, True):
            with pytest.raises(loading.CheckpointCorrupt, match="truncated or corrupt") as err:
                loading.load_checkpoint(short, mmap=mmap)
            assert "miniz" not in str(err.value) and "\n" not in str(err.value)
    # Where the zip reader answers EINVAL, as it does for an 800 KB file cut to 20,000 bytes
    # (its directory then points before the file's start): corrupt too.
    torch.save({"w": torch.zeros(200_000)}, short)
    short.write_bytes(short.read_bytes()[:20_000])
    with pytest.raises(OSError) as raised:
        torch.load(short, weights_only=True)
    assert raised.value.errno == errno.EINVAL
    with pytest.raises(loading.CheckpointCorrupt, match="its zip directory is missing"):
        loading.load_checkpoint(short)
    # EINVAL from an archive that Python's zip reader reads whole (an I/O error some file
    # systems report so) is about the file: it stays; a cut one is set aside by resume.
    read = torch.load

    def einval_for_newest(file, *args, **kwargs):
        if Path(file) == newest:
            raise OSError(errno.EINVAL, "Invalid argument")
        return read(file, *args, **kwargs)

    monkeypatch.setattr(torch, "load", einval_for_newest)
    with pytest.raises(loading.CheckpointError, match="cannot be read: Invalid argument") as err:
        loading.load_checkpoint(newest)
    assert not isinstance(err.value, loading.CheckpointCorrupt)
    newest.write_bytes(data[: len(data) // 3])
    capsys.readouterr()
    path, _ = ckpt.resume_point(tmp_path)
    assert path.name == "step_00000001.pt"
    assert (newest.parent / (newest.name + ".broken")).is_file() and not newest.exists()
    assert "set step_00000002.pt aside" in capsys.readouterr().err


def _flip(path, record_suffix, offset=100, count=16):
    """XOR ``count`` bytes ``offset`` bytes into the data of the zip record of ``path`` whose
    name ends with ``record_suffix``: the file's size and zip structure stay intact."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record_suffix))
    data = bytearray(path.read_bytes())
    header = info.header_offset
    name_length = int.from_bytes(data[header + 26 : header + 28], "little")
    extra_length = int.from_bytes(data[header + 28 : header + 30], "little")
    start = header + 30 + name_length + extra_length + offset
    for i in range(start, start + count):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_checkpoint_with_changed_bytes_is_corrupt_and_set_aside(tmp_path, capsys):
    """Bytes changed inside a tensor's record (bit rot, a bad copy) fail the record's CRC-32:
    refused, read or mapped, and set aside by resume, which goes on from the one before."""
    config = tiny_config("train.max_steps=2", "train.save_interval_steps=1")
    small_reverse_trainer(config, tmp_path).train()
    newest = loading.step_checkpoint_path(tmp_path, 2)
    intact = newest.read_bytes()
    _flip(newest, "data/1")
    assert len(newest.read_bytes()) == len(intact)
    assert torch.load(newest, weights_only=True)["step"] == 2  # PyTorch reads it as it is
    for mmap in (False, True):
        with pytest.raises(loading.CheckpointCorrupt, match=r"data/1 does not match its CRC-32"):
            loading.load_checkpoint(newest, mmap=mmap)
    capsys.readouterr()
    path, _ = ckpt.resume_point(tmp_path)
    assert path.name == "step_00000001.pt" and (newest.parent / (newest.name + ".broken")).exists()
    # Records written without a CRC (PyTorch's compute_crc32 off) are not judged by it.
    serialization = pytest.importorskip(
        "torch.utils.serialization", reason="this PyTorch cannot save without CRCs"
    ).config

    serialization.save.compute_crc32 = False
    try:
        torch.save(torch.load(path, weights_only=True), tmp_path / "no-crc.pt")
    finally:
        serialization.save.compute_crc32 = True
    assert loading.load_checkpoint(tmp_path / "no-crc.pt")["step"] == 1


def test_a_tokenizer_that_cannot_be_read_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "m.pt"
    _model_file(path, tiny_config(), seed=0, tokenizer=b"\x0a\x05garbage bytes")
    with pytest.raises(loading.CheckpointCorrupt, match=r"m\.pt: its tokenizer cannot be read"):
        loading.load_model(path)


def test_a_model_of_another_vocabulary_than_its_tokenizer_is_refused(tmp_path):
    from aiayn.data.corpus import tokenizer_path

    data = make_reverse_data(tmp_path / "text", n_train=200, n_valid=10)
    path = tmp_path / "m.pt"
    _model_file(path, tiny_config("model.vocab_size=40"), 0, tokenizer_path(data).read_bytes())
    with pytest.raises(loading.CheckpointError, match=r"m\.pt: its model has a vocabulary of 40 "):
        loading.load_model(path)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_inference_maps_the_checkpoint_instead_of_reading_it(tmp_path):
    """load_model's parameters are the checkpoint file's pages (no copy of the weights in
    the process), the tied embedding stays one parameter, and the values are the saved ones."""
    from aiayn.data.corpus import tokenizer_path
    from tests.helpers import file_spans

    data = make_reverse_data(tmp_path / "text", n_train=200, n_valid=10)
    config = tiny_config("model.vocab_size=13")
    path = tmp_path / "model.pt"
    saved = _model_file(path, config, 5, tokenizer_path(data).read_bytes())
    model = loading.load_model(path).model
    spans = file_spans(path)
    for name, parameter in model.named_parameters():
        start = parameter.data_ptr()
        assert any(lo <= start < hi for lo, hi in spans), f"{name} is not mapped"
        assert torch.equal(parameter, saved.get_parameter(name))
    assert model.out_proj.weight is model.tgt_embed.token.weight is model.src_embed.token.weight
    assert len(list(model.parameters())) == len(list(saved.parameters()))
    read = loading.load_model(path, mmap=False).model  # --no-mmap: in memory of its own
    spans = file_spans(path)
    for name, parameter in read.named_parameters():
        assert not any(lo <= parameter.data_ptr() < hi for lo, hi in spans), name
        assert torch.equal(parameter, saved.get_parameter(name))
    # A file cut short fails as it does when read: named, and called corrupt.
    short = tmp_path / "short.pt"
    short.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(loading.CheckpointCorrupt, match="truncated or corrupt"):
        loading.load_model(short)


def test_assigned_weights_take_the_models_dtypes_and_every_name():
    config = tiny_config("model.vocab_size=13")
    torch.manual_seed(0)
    saved = Transformer(config.model)
    state = {name: t.double() for name, t in saved.state_dict().items()}
    model = Transformer(config.model)
    loading.assign_weights(model, state)
    for name, parameter in model.named_parameters():
        assert parameter.dtype == torch.float32
        assert torch.equal(parameter, saved.get_parameter(name))
    assert model.out_proj.weight is model.tgt_embed.token.weight
    missing = next(name for name in state if name.startswith("decoder.layers.0."))
    del state[missing]
    with pytest.raises(RuntimeError, match=missing):
        loading.assign_weights(Transformer(config.model), state)


def test_a_full_disk_outside_a_run_says_to_write_elsewhere(tmp_path, monkeypatch):
    """save_atomic for a file that is no run's (average --out, import-marian): the message
    speaks of that file, not of resuming a run."""
    from aiayn.training.storage import RunDirectoryError

    def full(obj, handle, *rest, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(RunDirectoryError) as err:
        ckpt.save_atomic({"w": torch.zeros(10)}, tmp_path / "avg.pt", in_run=False)
    assert "no space left" in str(err.value) and str(err.value).endswith("write it elsewhere")
    with pytest.raises(RunDirectoryError, match="run resumes from its last checkpoint"):
        ckpt.save_atomic({"w": torch.zeros(10)}, tmp_path / "step.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary left


def test_averaging_names_a_missing_run_takes_its_checkpoints_folder_and_spares_step_files(
    tmp_path, monkeypatch
):
    with pytest.raises(loading.CheckpointError, match=r"nowhere does not exist"):
        averaging.average_run(tmp_path / "nowhere", 2)
    with pytest.raises(loading.CheckpointError, match=r"checkpoints to average \(--last\) must"):
        averaging.average_run(tmp_path, 0)
    config = tiny_config("train.max_steps=2", "train.save_interval_steps=1")
    small_reverse_trainer(config, tmp_path).train()
    folder = tmp_path / loading.CHECKPOINT_DIR
    assert averaging.average_run(folder, 2) == tmp_path / loading.AVERAGED_NAME
    step_1 = loading.step_checkpoint_path(tmp_path, 1)
    before = step_1.read_bytes()
    with pytest.raises(loading.CheckpointError, match="a run's step checkpoint"):
        averaging.average_run(tmp_path, 2, step_1)
    monkeypatch.chdir(folder)  # named from inside the folder too
    with pytest.raises(loading.CheckpointError, match="a run's step checkpoint"):
        averaging.average_run(tmp_path, 2, step_1.name)
    assert step_1.read_bytes() == before  # still what training resumes from
