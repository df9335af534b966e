import gzip
import io
import re
import tarfile
import urllib.error
import zipfile
from pathlib import Path

import pytest

from aiayn.data.corpus import Corpus, tokenizer_path
from aiayn.data.prepare import prepare_corpus
from aiayn.data.sources import bible, download, wmt14
from aiayn.data.sources.bible import bible_pairs, write_bible_corpus
from aiayn.data.sources.bible_text import VALID_BUCKETS, align_lengths, bible_split, clean_markup
from aiayn.data.sources.multi30k import download_multi30k
from aiayn.data.sources.wmt14 import download_wmt14, sgm_segments
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import UserError
from tests.helpers import BIBLE_MISSING

# -- markup -----------------------------------------------------------------------------------


def test_footnote_between_words_leaves_one_space_and_no_residue():
    osis = (
        '<w lemma="strong:H0430">God</w><note placement="foot"><reference type="annotateRef">1:1 '
        "</reference>The Hebrew word rendered “God” is “אֱלֹהִ֑ים” (Elohim).</note>"
        '<w lemma="strong:H1254">created</w> <w>the</w> <w>earth</w>.'
    )
    assert clean_markup(osis) == "God created the earth."


def test_note_before_punctuation_adds_no_space():
    osis = 'only born<note type="x-footnote">n</note>, <q who="Jesus">‘Son’</q><note>x</note>.'
    assert clean_markup(osis) == "only born, ‘Son’."


def test_canonical_titles_stay_editorial_headings_go():
    osis = (
        '<title type="section">David flees</title><div type="x-milestone" subType="x-preverse"/>'
        '<title canonical="true" type="psalm">A Psalm by David.</title> <lg sID="a"/>'
        '<l level="1" sID="b"/>Yahweh, how my adversaries have increased!<l eID="b"/>'
        '<l sID="c"/>Many rise up.<l eID="c"/>'
    )
    assert (
        clean_markup(osis)
        == "A Psalm by David. Yahweh, how my adversaries have increased! Many rise up."
    )


def test_words_around_block_tags_and_trans_change_are_separated():
    osis = (
        'ejército<transChange type="added">se llamaba</transChange><w>Sísara</w>, '
        'palabra<milestone type="x-p"/>otra «<hi type="italic">cita</hi>» &amp; fin<lb/>'
    )
    assert clean_markup(osis) == "ejército se llamaba Sísara, palabra otra «cita» & fin"


def test_text_after_the_end_of_the_book_is_dropped():
    osis = 'Amen. <chapter eID="Rev.22"/><div sID="g" type="glossary"/>Abba means father.'
    assert clean_markup(osis) == "Amen."


def test_thml_cross_references_are_dropped():
    thml = (
        'In the beginning<scripRef passage="John 1:1">John 1:1</scripRef> God'
        '<sync type="Strongs" value="H430"/> created'
    )
    assert clean_markup(thml) == "In the beginning God created"


# -- alignment and split ----------------------------------------------------------------------


def test_alignment_pairs_equal_sequences_one_to_one():
    lengths = [40, 80, 25, 120, 60, 33, 90]
    beads = align_lengths(lengths, lengths)
    assert beads == [(i, i + 1, i, i + 1) for i in range(len(lengths))]


def test_alignment_finds_a_merge_and_a_shift():
    english = [50, 30, 70, 20, 100, 45, 60, 80]
    # Spanish joins verses 1 and 2, then numbers one verse further (an empty slot at the end
    # of the merge), like the RV 1909 in Numbers 12-13.
    spanish = [52, 101, 0, 21, 98, 47, 61, 79]
    beads = align_lengths(english, spanish)
    assert (1, 3, 1, 2) in beads or (1, 3, 1, 3) in beads
    assert (4, 5, 4, 5) in beads and (7, 8, 7, 8) in beads
    covered_en = [i for a0, a1, _, _ in beads for i in range(a0, a1)]
    covered_es = [j for _, _, b0, b1 in beads for j in range(b0, b1)]
    assert covered_en == list(range(len(english))) and covered_es == list(range(len(spanish)))


def test_split_depends_on_the_first_reference_only():
    refs = [f"Gen.{c}.{v}" for c in range(1, 51) for v in range(1, 41)]
    splits = [bible_split(r) for r in refs]
    assert splits == [bible_split(r) for r in refs]
    share = splits.count("valid") / len(refs)
    assert abs(share - VALID_BUCKETS / 1000) < 0.01
    assert bible_split("Num.13.32+Num.13.33") == bible_split("Num.13.32")


# -- the embedded corpus (needs the SWORD modules that scripts/setup_env.sh installs) ----------


@pytest.fixture(scope="module")
def bible_dir(bible_cache):
    return bible_cache  # tests/conftest.py: the corpus text, written once per session


def _read(directory: Path, split: str) -> list[tuple[str, str, str]]:
    parts = [
        (directory / f"{split}.{k}").read_text(encoding="utf-8").splitlines()
        for k in ("ref", "en", "es")
    ]
    assert len({len(p) for p in parts}) == 1
    return list(zip(*parts, strict=True))


def test_bible_corpus_has_a_fixed_split_of_about_31000_pairs(bible_dir):
    rows = {split: _read(bible_dir / "bible", split) for split in ("train", "valid", "test")}
    total = sum(len(r) for r in rows.values())
    assert 30_000 <= total <= 32_000
    for split, split_rows in rows.items():
        assert all(bible_split(ref) == split for ref, _, _ in split_rows)
    assert 800 <= len(rows["valid"]) <= 1_300 and 800 <= len(rows["test"]) <= 1_300
    refs = [ref for r in rows.values() for ref, _, _ in r]
    assert len(set(refs)) == len(refs)


def test_bible_text_is_clean(bible_dir):
    by_ref = {}
    for split in ("train", "valid", "test"):
        for ref, en, es in _read(bible_dir / "bible", split):
            for text in (en, es):
                assert text == text.strip() and "  " not in text
                assert not re.search(r"[<>&]|\bstrong:|annotateRef", text), text
                # Glued words: a lower-case letter straight before an upper-case one.
                assert not re.search(r"[a-zà-ÿ][A-ZÀ-Þ]", text), text
                # No space before punctuation, except the WEB's own "‘…’ ?" spacing.
                assert not re.search(r"(?<!’) [,.;:!?]", text), text
            by_ref[ref] = (en, es)
    # A footnote sits between "God" and "created" in the module; an end-of-verse note too.
    assert by_ref["Gen.1.1"][0] == "In the beginning, God created the heavens and the earth."
    assert by_ref["John.3.16"][0].startswith(
        "For God so loved the world, that he gave his only born Son,"
    )
    # The Spanish module numbers Numbers 13 like the Hebrew Bible: realigned by length.
    assert by_ref["Num.13.2"][1].startswith("Envía tú hombres")
    # The KJV-style subscription after an epistle is not part of the verse.
    assert by_ref["Heb.13.25"][1] == "La gracia sea con todos vosotros. Amén."
    assert "Glossary" not in by_ref["Rev.22.21"][0]


def test_bible_corpus_is_reused_when_present(bible_dir, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("should not be read again")

    monkeypatch.setattr(bible, "bible_pairs", fail)
    prefixes = write_bible_corpus(bible_dir / "bible")
    assert Path(f"{prefixes['train']}.en").is_file()


def test_prepare_bible_corpus_end_to_end(bible_dir, tmp_path):
    manifest = prepare_corpus(
        "bible", tmp_path / "data", vocab_size=2000, cache_dir=bible_dir, src="es", tgt="en"
    )
    assert (manifest["src"], manifest["tgt"]) == ("es", "en")
    assert set(manifest["splits"]) == {"train", "valid", "test"}
    test = Corpus.open(tmp_path / "data", "test")
    references = (bible_dir / "bible" / "test.en").read_text(encoding="utf-8").splitlines()
    assert test.tgt_texts() == references
    tokenizer = Tokenizer.load(tokenizer_path(tmp_path / "data"))
    assert tokenizer.vocab_size == 2000
    assert tokenizer.decode(test.pair(0)[1].tolist()) == references[0]


@pytest.mark.skipif(bool(BIBLE_MISSING), reason=BIBLE_MISSING)
def test_bible_from_a_module_zip(tmp_path):
    archive = tmp_path / "modules.zip"
    root = bible.DEBIAN_SWORD_DIR
    with zipfile.ZipFile(archive, "w") as zf:
        for path in root.rglob("*"):
            if path.is_file():
                zf.write(path, path.relative_to(root))
    first = next(iter(bible_pairs(archive)))
    assert first.ref == "Gen.1.1" and first.es.startswith("EN el principio crió Dios")


def test_missing_modules_explain_how_to_get_them(tmp_path):
    (tmp_path / "mods.d").mkdir()
    with pytest.raises(UserError, match="sword-text-web"):
        next(iter(bible_pairs(tmp_path)))
    with pytest.raises(UserError, match="no such SWORD"):
        next(iter(bible_pairs(tmp_path / "missing")))


def test_sword_module_download_uses_crosswire(tmp_path, monkeypatch):
    requested = _serve(
        monkeypatch,
        {
            "https://www.crosswire.org/ftpmirror/pub/sword/packages/rawzip/WEB.zip": b"zip",
            "https://www.crosswire.org/ftpmirror/pub/sword/packages/rawzip/SpaRV1909.zip": b"zip",
        },
    )
    paths = bible.download_sword_modules(tmp_path)
    assert len(requested) == 2
    assert [p.name for p in paths] == ["WEB.zip", "SpaRV1909.zip"]
    assert all(p.read_bytes() == b"zip" for p in paths)


# -- downloads (no network: fetch serves local files) ------------------------------------------


def _serve(monkeypatch, files: dict[str, bytes]) -> list[str]:
    requested: list[str] = []

    def fake_fetch(url: str, dest: Path, report: object = None) -> None:
        requested.append(url)
        if url not in files:
            raise UserError(f"{url}: download failed (404)")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(files[url])

    monkeypatch.setattr(download, "fetch", fake_fetch)
    return requested


def test_multi30k_download_and_cache(tmp_path, monkeypatch):
    base = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/"
    content = {
        (stem, lang): f"{stem} {lang} one\n{stem} {lang} two\n"
        for stem in ("train", "val", "test_2016_flickr")
        for lang in ("en", "de")
    }
    files = {f"{base}{s}.{lang}.gz": gzip.compress(t.encode()) for (s, lang), t in content.items()}
    requested = _serve(monkeypatch, files)
    prefixes = download_multi30k(tmp_path, "en", "de")
    assert sorted(requested) == sorted(files)
    for split, stem in (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr")):
        for lang in ("en", "de"):
            assert Path(f"{prefixes[split]}.{lang}").read_text() == content[stem, lang]
    requested.clear()
    download_multi30k(tmp_path, "en", "de")
    assert requested == []
    with pytest.raises(UserError, match="no 'xx' side"):
        download_multi30k(tmp_path, "en", "xx")


def _tgz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


SRC_SGM = b"""<srcset setid="newstest2014"><doc docid="1">
<seg id="1">Gutach: Increased safety &amp; &quot;more&quot;</seg>
<seg id="2">Two</seg>
</doc></srcset>
"""
REF_SGM = b"""<refset setid="newstest2014"><doc docid="1">
<seg id="1"> Gutach: Mehr Sicherheit </seg>
<seg id="2">Zwei</seg>
</doc></refset>
"""


def test_wmt14_download_concatenates_the_training_corpora(tmp_path, monkeypatch):
    files = {
        "https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz": _tgz(
            {
                "training/europarl-v7.de-en.en": b"Resumption of the session\n",
                "training/europarl-v7.de-en.de": b"Wiederaufnahme der Sitzungsperiode\n",
                "training/europarl-v7.fr-en.en": b"not this one\n",
            }
        ),
        "https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz": _tgz(
            {"commoncrawl.de-en.en": b"crawl en", "commoncrawl.de-en.de": b"crawl de"}  # no newline
        ),
        "https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz": _tgz(
            {
                "training/news-commentary-v9.de-en.en": b"news en\n",
                "training/news-commentary-v9.de-en.de": b"news de\n",
            }
        ),
        "https://www.statmt.org/wmt14/dev.tgz": _tgz(
            {"dev/newstest2013.en": b"dev en\n", "dev/newstest2013.de": b"dev de\n"}
        ),
        "https://www.statmt.org/wmt14/test-full.tgz": _tgz(
            {
                "test-full/newstest2014-deen-src.en.sgm": SRC_SGM,
                "test-full/newstest2014-deen-ref.de.sgm": REF_SGM,
            }
        ),
    }
    requested = _serve(monkeypatch, files)
    prefixes = download_wmt14(tmp_path)
    assert sorted(requested) == sorted(files)
    assert (
        Path(f"{prefixes['train']}.en").read_text()
        == "Resumption of the session\ncrawl en\nnews en\n"
    )
    assert Path(f"{prefixes['train']}.de").read_text().splitlines()[1] == "crawl de"
    assert Path(f"{prefixes['valid']}.de").read_text() == "dev de\n"
    assert Path(f"{prefixes['test']}.en").read_text() == 'Gutach: Increased safety & "more"\nTwo\n'
    assert Path(f"{prefixes['test']}.de").read_text() == "Gutach: Mehr Sicherheit\nZwei\n"
    requested.clear()
    download_wmt14(tmp_path)
    assert requested == []


def test_damaged_archive_is_a_user_error(tmp_path, monkeypatch):
    url = "https://www.statmt.org/wmt14/dev.tgz"
    files = {u: _tgz({}) for u, _ in wmt14.WMT14_TRAIN}
    files[url] = b"this is not a tar file"
    _serve(monkeypatch, files)
    (tmp_path / "wmt14").mkdir()
    for lang in ("en", "de"):
        (tmp_path / "wmt14" / f"train.{lang}").write_text("x\n")
    with pytest.raises(UserError, match=r"dev\.tgz"):
        download_wmt14(tmp_path)
    assert not list((tmp_path / "wmt14").glob("valid.*"))


def test_fetch_failure_is_a_user_error_and_leaves_no_file(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(download.urllib.request, "urlopen", refuse)
    with pytest.raises(UserError, match="download failed"):
        download.fetch("https://example.invalid/file.gz", tmp_path / "file.gz")
    assert list(tmp_path.iterdir()) == []


def test_sgm_segments_decode_entities():
    assert sgm_segments('<seg id="1">a &lt;b&gt;</seg>\n<seg id=2>c</seg>') == "a <b>\nc\n"


def test_a_damaged_module_zip_is_a_user_error(tmp_path):
    (tmp_path / "broken.zip").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(UserError, match=r"broken\.zip"):
        next(iter(bible_pairs(tmp_path / "broken.zip")))
