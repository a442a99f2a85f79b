"""`ninfer-quantize convert --draft-vocab-size N [--draft-vocab-corpus TEXT]` (runtime/draft_head.py): the MTP
drafts' own head, the lm_head rows of the most used ids in q4, on a copy of the tiny dense checkpoint whose tokenizer
has 1000 words and two added tokens; the rows against the lm_head's own (converted in q4 too), the ranking against the
corpus's counts, `verify`, and the refusals (nothing written)."""
import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from ninfer.cli.quantize import main
from ninfer.runtime.artifact import open_artifact
from ninfer.runtime.draft_head import DRAFT_HEAD, DRAFT_VOCAB, check_draft_head
from tests.fixtures.tiny_checkpoints import build, with_word_tokenizer

WORDS = 1000   # ids 0..999; added tokens 1000 and 1001: the tokenizer's domain is 1002 of the 1024 lm_head rows


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    d = with_word_tokenizer(build("dense", root / "ckpt"), root / "dense", WORDS)
    corpus = root / "corpus.txt"
    corpus.write_text("w700 w700 w700 w5\nw5 w900 <|im_end|>\n" + "w900 w700\n" * 3, encoding="utf-8")
    return d, corpus


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_the_draft_head_is_the_most_used_ids_rows(hf, tmp_path):
    d, corpus = hf
    out = tmp_path / "a.ninfer"
    r = cli("convert", d, "-o", out, "--override", "lm_head=q4", "--draft-vocab-size", 130,
            "--draft-vocab-corpus", corpus, "--no-progress")
    assert r.exit_code == 0, r.output
    assert "draft head: 256 of 1024 lm_head rows in q4" in r.output
    with open_artifact(out) as a:
        e = a.tensors[DRAFT_HEAD]
        assert (e.shape, e.format, e.role, e.flags) == ((256, 256), "q4", DRAFT_HEAD, ("mtp",))
        meta = json.loads(a.resource(DRAFT_VOCAB))
        # added tokens, then by count (w700: 6, w900: 4, w5: 2), then every other id in id order; no padding row
        rest = [i for i in range(1002) if i not in (1000, 1001, 700, 900, 5)]
        assert meta["ids"] == ([1000, 1001, 700, 900, 5] + rest)[:256] and meta["corpus_tokens"] == 13
        assert "13 tokens of corpus.txt" in meta["ranking"]
        # q4 encodes a row on its own: the draft rows are the lm_head's rows (both q4) at those ids, bit for bit
        assert np.array_equal(a.decode(DRAFT_HEAD), a.decode("lm_head")[meta["ids"]])
        assert check_draft_head(a) == []
    r = cli("verify", out)
    assert r.exit_code == 0 and "match recipe qwen3_5" in r.output, r.output


def test_without_a_corpus_the_ranking_is_id_order_and_the_format_is_chosen(hf, tmp_path):
    d, _ = hf
    out = tmp_path / "b.ninfer"
    r = cli("convert", d, "-o", out, "--draft-vocab-size", 128, "--draft-vocab-format", "w8", "--no-progress")
    assert r.exit_code == 0, r.output
    with open_artifact(out) as a:
        assert json.loads(a.resource(DRAFT_VOCAB))["ids"] == [1000, 1001, *range(126)]
        assert a.tensors[DRAFT_HEAD].format == "w8" and a.tensors["lm_head"].format == "q6"   # the recipe's head
    assert cli("verify", out).exit_code == 0
    plain = tmp_path / "c.ninfer"
    assert cli("convert", d, "-o", plain, "--no-progress").exit_code == 0
    with open_artifact(plain) as a:   # none asked for: neither the tensor nor its ids
        assert DRAFT_HEAD not in a.tensors and DRAFT_VOCAB not in a.resources and check_draft_head(a) == []


@pytest.mark.parametrize("args,message", [
    (["--draft-vocab-size", 1000], r"must leave out part of the 1002 ids .*1 \.\. 896"),
    (["--draft-vocab-size", 64, "--skip", "mtp"], "serves the MTP layer's drafts"),
    (["--draft-vocab-corpus", "CORPUS"], "give --draft-vocab-size too"),
    (["--draft-vocab-size", 64, "--draft-vocab-corpus", "MISSING"], "No such file"),
    (["--draft-vocab-size", 64, "--draft-vocab-corpus", "LATIN1"], "not UTF-8 text"),
    (["--draft-vocab-size", 64, "--draft-vocab-corpus", "EMPTY"], "no tokens"),
])
def test_bad_draft_head_options_are_refused_and_nothing_is_written(hf, tmp_path, args, message):
    d, corpus = hf
    (tmp_path / "latin1.txt").write_bytes("w1 caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    files = {"CORPUS": corpus, "MISSING": tmp_path / "nope.txt", "LATIN1": tmp_path / "latin1.txt",
             "EMPTY": tmp_path / "empty.txt"}
    out = tmp_path / "x.ninfer"
    r = cli("convert", d, "-o", out, "--no-progress", *[files.get(a, a) for a in args])
    assert r.exit_code != 0 and re.search(message, r.output), r.output
    assert not out.exists() and not list(tmp_path.glob(".x.ninfer*"))


def _rewrite_entry(path, name, **fields):
    """Change a tensor's directory entry in place (same header length: the payload stays where it is)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[8:16], "little")
    doc = json.loads(raw[16:16 + n])
    next(t for t in doc["tensors"] if t["name"] == name).update(fields)
    js = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(raw[:16] + js + b" " * (n - len(js)) + raw[16 + n:])


def test_verify_checks_the_draft_head_against_its_ids(hf, tmp_path):
    """A draft head whose shape or role no longer matches its ids (a hand-edited directory; q4 keeps the byte count
    at K 250) fails `verify` by name."""
    d, corpus = hf
    out = tmp_path / "v.ninfer"
    assert cli("convert", d, "-o", out, "--draft-vocab-size", 128, "--no-progress").exit_code == 0
    _rewrite_entry(out, DRAFT_HEAD, shape=[128, 250])
    r = cli("verify", out)
    assert r.exit_code != 0 and "tensor lm_head_draft has shape [128, 250], its ids expect [128, 256]" in r.output, r.output
    _rewrite_entry(out, DRAFT_HEAD, shape=[128, 256], role="lm_head")
    r = cli("verify", out)
    assert r.exit_code != 0 and "must have role lm_head_draft" in r.output, r.output
    _rewrite_entry(out, DRAFT_HEAD, role=DRAFT_HEAD)
    assert cli("verify", out).exit_code == 0
