"""The MTP drafts' own head, built at conversion (NInfer's --lm-head-draft; `ninfer-quantize convert
--draft-vocab-size N`): the lm_head rows of the N token ids most used, most used first, in a format of their own
(q4 by default, whatever the lm_head's), with their ids in the resource draft_vocab.json. An MTP draft then reads
N rows of q4 instead of the whole q6 head; the target still verifies over the whole vocabulary, so output is
unchanged (runtime/speculative.py DraftVocab). "Most used": the tokenizer's added tokens (end of turn, thinking
and tool-call tags) first, then the ids a corpus of the user's own text encodes to, by count, then the rest in id
order (byte-level BPE numbers tokens in merge order, so a low id is a frequent one)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .artifact_schema import ArtifactError
from .convert import ConversionPlan, ConvertError
from .format_base import TILE_ROWS, align_up
from .formats import get_format
from .recipes import BoundTensor

DRAFT_HEAD = "lm_head_draft"          # tensor name and role
DRAFT_VOCAB = "draft_vocab.json"      # resource: {"ids": [...], "ranking": ..., "corpus_tokens": n}
DRAFT_IDS = DRAFT_HEAD + ".ids"       # the loaded weights' int32 tensor of those ids (runtime/weights.py)
CORPUS_PIECE = 1 << 20                # characters tokenized at a time


def rank_ids(tokenizer_json: bytes, corpus: list[Path], vocab: int) -> tuple[list[int], int]:
    """Every id the tokenizer can produce among `vocab` rows (engine.token_domain: not the padding rows), most used
    first (see the module docstring), and how many corpus tokens were counted."""
    from .tokenizer import Tokenizer, TokenizerError, added_ids, id_domain
    try:
        tok = Tokenizer(tokenizer_json)
    except TokenizerError as e:
        raise ConvertError(f"--draft-vocab-size: {e}") from None
    parsed = json.loads(tokenizer_json)
    vocab = id_domain(parsed, vocab)
    counts = np.zeros(vocab, np.int64)
    total = 0
    for path in corpus:
        try:
            with open(path, encoding="utf-8") as f:
                while piece := f.read(CORPUS_PIECE) + f.readline():   # whole lines, so no word is cut in two
                    ids = np.asarray(tok.encode(piece), np.int64)
                    ids = ids[ids < vocab]
                    counts += np.bincount(ids, minlength=vocab)
                    total += len(ids)
        except UnicodeDecodeError as e:
            raise ConvertError(f"--draft-vocab-corpus {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise ConvertError(f"--draft-vocab-corpus {path}: {e.strerror or e}") from None
    if corpus and total == 0:
        raise ConvertError(f"--draft-vocab-corpus {', '.join(map(str, corpus))}: no tokens (empty text)")
    added = [i for i in added_ids(parsed) if i < vocab]
    key = counts.astype(np.float64)
    key[added] = np.inf                       # the added tokens first, whatever the corpus
    order = np.lexsort((np.arange(vocab), -key))   # by count, most first; ties (and unseen ids) by id
    return order.tolist(), total


def add_draft_head(plan: ConversionPlan, size: int, corpus: list[Path], fmt: str = "q4") -> str:
    """Append the draft head (a tensor gathered row by row from the lm_head's source, or the embedding's when they
    are tied) and its ids to the plan. Returns a note for the user."""
    if not any("mtp" in t.flags for t in plan.tensors):
        raise ConvertError("--draft-vocab-size: the draft head serves the MTP layer's drafts, and this conversion "
                           "carries none (the checkpoint has no mtp.* tensors, or --skip mtp)")
    head = next((t for t in plan.tensors if t.name == "lm_head"), None) or next(t for t in plan.tensors if t.name == "embed")
    (src, start, _), = head.segments      # one source tensor, rows in id order
    vocab, hidden = head.shape
    rows = align_up(size, TILE_ROWS)      # whole tiles of the packed formats and the GEMV routes
    try:
        tokenizer = dict(plan.resources)["tokenizer.json"]
    except KeyError:
        raise ConvertError("--draft-vocab-size: the checkpoint has no tokenizer.json to rank the ids by") from None
    ids, counted = rank_ids(tokenizer, list(corpus), vocab)
    if not 1 <= size <= rows < len(ids):
        raise ConvertError(f"--draft-vocab-size {size}: must leave out part of the {len(ids)} ids the tokenizer "
                           f"can produce (1 .. {(len(ids) - 1) // TILE_ROWS * TILE_ROWS}: whole {TILE_ROWS}-row tiles)")
    ids = ids[:rows]
    t = BoundTensor(DRAFT_HEAD, (rows, hidden), DRAFT_HEAD, "quant", fmt, ("mtp",),
                    [(src, start + i * hidden, hidden) for i in ids])
    get_format(fmt).check_shape(t.shape, t.name)
    plan.tensors.append(t)
    ranking = (f"added tokens, then {counted} tokens of {', '.join(Path(p).name for p in corpus)} by count, then id order"
               if corpus else "added tokens, then id order")
    plan.resources.append((DRAFT_VOCAB, json.dumps({"ids": ids, "ranking": ranking, "corpus_tokens": counted},
                                                   separators=(",", ":")).encode("utf-8")))
    return f"draft head: {rows} of {vocab} lm_head rows in {fmt} ({ranking})"


def check_draft_head(art) -> list[str]:
    """An artifact's draft head against its ids: problems, none when it has no draft head (or is consistent)."""
    entry = art.tensors.get(DRAFT_HEAD)
    has_ids = DRAFT_VOCAB in art.resources
    if entry is None:
        return [f"resource {DRAFT_VOCAB} without the tensor {DRAFT_HEAD}"] if has_ids else []
    if not has_ids:
        return [f"tensor {DRAFT_HEAD} without its ids (resource {DRAFT_VOCAB})"]
    ids = draft_ids(art)
    head = art.tensors.get("lm_head") or art.tensors["embed"]
    problems = []
    if len(entry.shape) != 2 or entry.shape[0] != len(ids) or entry.shape[1] != head.shape[1]:
        problems.append(f"tensor {DRAFT_HEAD} has shape {list(entry.shape)}, its ids expect [{len(ids)}, {head.shape[1]}]")
    if len(set(ids)) != len(ids) or not all(isinstance(i, int) and 0 <= i < head.shape[0] for i in ids):
        problems.append(f"{DRAFT_VOCAB}: ids must be distinct integers in 0..{head.shape[0] - 1}")
    if entry.role != DRAFT_HEAD or tuple(entry.flags) != ("mtp",):
        problems.append(f"tensor {DRAFT_HEAD} must have role {DRAFT_HEAD} and flags ['mtp']")
    return problems


def draft_ids(art) -> list[int]:
    """The draft head's ids, row by row (most used first)."""
    try:
        ids = json.loads(art.resource(DRAFT_VOCAB))["ids"]
    except (ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{art.path}: resource {DRAFT_VOCAB} is not a JSON object with an ids list: {e}") from None
    if not isinstance(ids, list):
        raise ArtifactError(f"{art.path}: resource {DRAFT_VOCAB}: ids must be a list")
    return ids
