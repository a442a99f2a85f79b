"""Speculative decoding (vLLM's `--speculative-config`): drafts from the checkpoint's own MTP layer
(`{"method": "mtp", "num_speculative_tokens": K}`, NInfer's `--spec mtp --draft-tokens K`) or from the sequence's own
tokens (`{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`: the
tokens that followed the latest earlier occurrence of its last n tokens, as vLLM's n-gram / prompt-lookup proposer;
what a coding agent's edits repeat).

A round, for every lane: the target runs the lane's last token and its K drafts in one verify step (K + 1 tokens a
lane) and picks its own token at every row, as plain decoding would there (argmax, or the sample op with the counter
the token's position has in plain decoding and the penalty counts of the drafts before it); the drafts equal to those
picks are accepted and the pick after them comes free, so a round commits 1..K+1 tokens, exactly the tokens plain
decoding produces (with a seed, the same draws). For a draft that is one token (the MTP layer's argmax), keeping it
when the target's draw equals it is rejection sampling as in Leviathan et al.: kept with probability p(d), and
otherwise a draw from p without d.
The verify step writes KV at every position it ran (positions past the accepted ones are rewritten before any step
reads them) and runs each GDN layer as one gdn_verify, which reads the lanes' states and writes none; the round then
commits: gdn_verify again over the same inputs, each lane's states advanced over the tokens it kept (commit_round).
Then the MTP layer reads (the target's final-normed hidden h_t, token t+1) for each kept token, which extends its own
KV, and its last row drafts the next round's first token; K - 1 further MTP steps each pair the previous MTP output
with the draft it chose. Prefill runs the MTP layer over every prompt chunk too (its KV at every prompt position). N-gram drafts
come from an index of the sequence's n-grams, updated as tokens are committed.

A round is a CUDA-graph replay (verify_graph.py: verify, the draws, acceptance count, commit, MTP steps; fewer n-gram
drafts are padded and never accepted; a lane keeps no rows past an accepted stop token) unless, with MTP, a lane near
its end verifies fewer than K drafts; such rounds are launched op by op.
"""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from .decode_graph import count_tokens
from .draft_head import DRAFT_HEAD, DRAFT_IDS
from .format_base import TILE_ROWS, align_up
from .models.blocks import commit_round, linear
from .tokenizer import added_ids
from .verify_graph import VerifyStep
from .weights import PackedWeight, split_rows

log = logging.getLogger("ninfer.speculative")
METHODS = ("mtp", "ngram")
# NInfer takes 1..5 MTP drafts; past 8 a verify step of 8 lanes (72 tokens) is far past where the GEMMs stop costing
# what one token costs (the GEMV routes end at 16 tokens)
MAX_SPECULATIVE_TOKENS = 8


class SpeculativeConfigError(ValueError):
    pass


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "mtp"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int | None = None   # ngram: the longest suffix looked up (default 4)
    prompt_lookup_min: int | None = None   # ngram: the shortest (default 2)
    draft_vocab_size: int | None = None    # mtp: draft over the first this many ids (+ the added tokens); see DraftVocab

    def __post_init__(self):
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"speculative method {self.method!r} is not supported (supported: "
                                         f"{', '.join(METHODS)})")
        _count("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        if self.method == "ngram":
            hi = 4 if self.prompt_lookup_max is None else self.prompt_lookup_max
            lo = self.prompt_lookup_min
            if lo is None:
                lo = min(2, hi) if isinstance(hi, int) else hi
            _count("prompt_lookup_max", hi, 16)
            _count("prompt_lookup_min", lo, hi)
            object.__setattr__(self, "prompt_lookup_max", hi)
            object.__setattr__(self, "prompt_lookup_min", lo)
        elif self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
            raise SpeculativeConfigError("prompt_lookup_max / prompt_lookup_min apply to method 'ngram' only")
        if self.draft_vocab_size is not None:
            if self.method != "mtp":
                raise SpeculativeConfigError("draft_vocab_size applies to method 'mtp' only (n-gram drafts read no lm_head)")
            _count("draft_vocab_size", self.draft_vocab_size, 1 << 24)

    @classmethod
    def parse(cls, text: str) -> "SpeculativeConfig":
        """From vLLM's JSON form: {"method": "mtp", "num_speculative_tokens": 3}."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise SpeculativeConfigError('--speculative-config must be a JSON object such as '
                                         '{"method": "mtp", "num_speculative_tokens": 3}')
        known = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "draft_vocab_size")
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)} (known: "
                                         f"{', '.join(known)})")
        return cls(d.get("method", "mtp"), d.get("num_speculative_tokens", 3), d.get("prompt_lookup_max"),
                   d.get("prompt_lookup_min"), d.get("draft_vocab_size"))


def _count(name: str, v, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
        raise SpeculativeConfigError(f"{name} must be an integer in 1..{hi}, got {v!r}")


def added_token_ids(art) -> list[int]:
    """The ids of the tokenizer's added tokens (<|im_end|>, <think>, the tool-call tags, ...), none without one."""
    try:
        return added_ids(json.loads(art.resource("tokenizer.json"))) if art is not None else []
    except KeyError:
        return []


def _rows_of(w) -> int:
    return w.matrix[0] if isinstance(w, PackedWeight) else w.shape[0]


def _device_of(w) -> torch.device:
    return (w.data if isinstance(w, PackedWeight) else w).device


class DraftVocab:
    """The lm_head rows the MTP drafts are drawn from (speculative-config `draft_vocab_size` N, NInfer's
    --lm-head-draft shortlist) and the id of each row: a draft is the argmax over those rows' logits, mapped to its id.
    The target verifies over the whole vocabulary, so the output is unchanged; a draft outside the shortlist is
    merely never proposed. Two sources:
    - the artifact's draft head (`ninfer-quantize convert --draft-vocab-size`, runtime/draft_head.py): its first N
      rows (whole 128-row tiles), the most used ids first, in a format of their own (q4);
    - without one, views of the lm_head's storage (no copy): ids below N in whole tiles (byte-level BPE numbers its
      tokens in merge order, so the low ids are the frequent ones) and the tiles holding the tokenizer's added tokens
      (the end of a turn, thinking and tool-call tags).
    Either way a draft reads about N / V of the head's bytes."""

    def __init__(self, parts: list, ids, device):
        self.parts = parts                       # [(weight, logits kept of its rows)]
        self.ids = torch.as_tensor(ids, dtype=torch.int32, device=device)

    @classmethod
    def from_lm_head(cls, lm_head, n: int, added: list[int], domain: int) -> "DraftVocab":
        rows = _rows_of(lm_head)
        p = min(align_up(n, TILE_ROWS), rows)
        if p >= domain:
            raise SpeculativeConfigError(f"draft_vocab_size {n} covers the whole vocabulary ({domain} ids): leave it out")
        parts, ids = [(cls._rows(lm_head, 0, p), p)], list(range(p))
        extra = [a for a in added if p <= a < domain]
        if extra:
            t0 = extra[0] // TILE_ROWS * TILE_ROWS
            t1 = min(align_up(extra[-1] + 1, TILE_ROWS), rows)
            parts.append((cls._rows(lm_head, t0, t1), min(t1, domain) - t0))
            ids += range(t0, min(t1, domain))
        return cls(parts, ids, _device_of(lm_head))

    @classmethod
    def from_draft_head(cls, head, head_ids, n: int, domain: int) -> "DraftVocab":
        rows, dev = _rows_of(head), _device_of(head)
        head_ids = torch.as_tensor(head_ids, dtype=torch.int32, device=dev)   # (the loaded ids: no copy)
        p = align_up(n, TILE_ROWS)
        if p > rows:
            raise SpeculativeConfigError(f"draft_vocab_size {n} is more than the artifact's draft head holds ({rows} rows; "
                                         f"convert with a larger --draft-vocab-size, or ask for at most {rows})")
        if len(head_ids) != rows or not 0 <= int(head_ids[:p].min()) <= int(head_ids[:p].max()) < domain:
            raise SpeculativeConfigError(f"the artifact's draft head: {len(head_ids)} ids for {rows} rows, or an id "
                                         f"outside the {domain} the tokenizer produces (reconvert it)")
        return cls([(cls._rows(head, 0, p), p)], head_ids[:p], dev)

    @staticmethod
    def _rows(w, a: int, b: int):
        """Rows [a, b) of a head as a view of its storage."""
        for cut, part in ((b, 0), (a, 1)):   # cut at b, keep the rows before it; then at a, keep those after
            if 0 < cut < _rows_of(w):
                pieces = split_rows(w, cut)
                if pieces is None:
                    raise SpeculativeConfigError(f"draft_vocab_size: the head's storage does not split at row {cut}")
                w = pieces[part]
        return w

    def argmax(self, be, hidden: torch.Tensor, out: torch.Tensor) -> None:
        """out[i] = the id of the draft rows' highest logit for hidden row i (final-normed)."""
        logits = [linear(be, hidden, w) for w, _ in self.parts]
        logits = torch.cat([x[:, :k] for x, (_, k) in zip(logits, self.parts)], dim=1) if len(logits) > 1 else logits[0]
        idx = torch.empty_like(out)
        be.run("argmax", logits=logits, ids=idx, domain=logits.shape[1])
        out.copy_(self.ids.index_select(0, idx))


class NgramIndex:
    """Where each n-gram (n in lo..hi) of a sequence's tokens last ended, kept up to date as tokens come, so a lookup
    costs O(hi) a round: drafts = the tokens after the latest earlier occurrence of the longest matching suffix, read
    on periodically where they reach the end (a run that repeats continues as it repeats)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi, self.last, self.seen = lo, hi, {}, 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for e in range(self.seen, len(tokens) - 1):   # n-grams ending before the last token (one follows each)
            for n in range(self.lo, min(self.hi, e + 1) + 1):
                self.last[tuple(tokens[e + 1 - n:e + 1])] = e
        self.seen = max(self.seen, len(tokens) - 1)
        for n in range(min(self.hi, len(tokens)), self.lo - 1, -1):
            e = self.last.get(tuple(tokens[-n:]))
            if e is not None:   # what followed it; where that runs into the end, the same period again (a repeat)
                period = len(tokens) - 1 - e
                return [tokens[e + 1 + i % period] for i in range(k)]
        return []


class Speculator:
    """The engine's speculative rounds (see the module docstring); counters as vLLM reports them."""

    def __init__(self, engine, config: SpeculativeConfig):
        self.engine, self.k = engine, config.num_speculative_tokens
        self.config, self.mtp = config, config.method == "mtp"
        self.stats = dict(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0)
        self.accepted_per_pos = [0] * self.k
        self.verify: dict[int, VerifyStep] = {}   # per batch size, made on first use
        self.static = True   # rounds that can use a VerifyStep do (False: every round op by op; A/B and tests)
        self._row_counts = None   # the VerifySteps' penalty counts per row, made once
        self.draft_vocab = None
        if config.draft_vocab_size is not None:
            head, n = engine.weights.get(DRAFT_HEAD), config.draft_vocab_size
            self.draft_vocab = (DraftVocab.from_draft_head(head, engine.weights[DRAFT_IDS], n, engine.domain)
                                if head is not None
                                else DraftVocab.from_lm_head(engine.model.lm_head, n, added_token_ids(engine.art), engine.domain))

    # -- prefill ---------------------------------------------------------------------------------
    def after_prefill(self, seq, a: int, b: int, normed: torch.Tensor | None) -> None:
        """After prompt chunk [a, b): with MTP, the layer over the chunk's pairs (h_t, token t+1) (normed: the chunk's
        final-normed hidden; None when nothing ran) once token b is known (the prompt's next token, or the first
        generated one); after the last chunk, the drafts of the first round."""
        seq.drafts = []
        if len(seq.tokens) <= b or seq.finish_reason is not None and b == len(seq.prompt):
            return   # nothing sampled (max_new 0), or finished at once: no round follows
        if not self.mtp:
            if b == len(seq.prompt):
                self._ngram([seq])
            return
        if normed is None:
            return   # the prompt was cached whole: the first round verifies no drafts
        out = self._mtp([seq], [(a, b)], normed)
        if b == len(seq.prompt):
            self._draft([seq], out[-1:])

    # -- a round -----------------------------------------------------------------------------------
    def round(self, seqs) -> None:
        """Verify each sequence's drafts, commit what holds (1..K+1 tokens each; the lanes' GDN states advanced over
        them), and draft the next round."""
        e = self.engine
        spare = e.cache.available_pages   # shared in order: a lane may take what the lanes before it left
        for seq in seqs:   # drafts the lane may still use: within max_new, the context and the spare pages
            seq.drafts = seq.drafts[:self._budget(seq, spare)]
            spare -= self._new_pages(seq, len(seq.drafts))
        spans = [(len(s.tokens) - 1, len(s.tokens) + len(s.drafts)) for s in seqs]
        targets, normed, pending, proposed, static = self._verify(seqs, spans)
        kept, committed = [], []
        for seq, t in zip(seqs, targets):
            drafts = seq.drafts
            n = 0
            while n < len(drafts) and drafts[n] == t[n]:
                n += 1
            if drafts:
                self.stats["num_drafts"] += 1
                self.stats["num_draft_tokens"] += len(drafts)
                self.stats["num_accepted_tokens"] += n
                for i in range(n):
                    self.accepted_per_pos[i] += 1
            m = 0
            for tok in drafts[:n] + [t[n]]:
                e._accept(seq, tok)
                committed.append((seq.slot, tok))
                m += 1
                if seq.finish_reason is not None:
                    break
            kept.append(m)
            seq.drafts = []
        if not static:   # the penalties' counts, as plain decoding adds them (a static round counted on the device)
            slots, toks = zip(*committed)
            count_tokens(e._counts, torch.tensor(slots, dtype=torch.int32, device=e.device),
                         torch.tensor(toks, dtype=torch.int32, device=e.device))
        if pending is not None:   # an op-by-op verify step: its GDN states advanced over the tokens kept
            commit_round(e.be, pending.keep, pending.query_start, pending.state_slots,
                         torch.tensor(kept, dtype=torch.int32, device=e.device))
        live = [(i, s) for i, s in enumerate(seqs) if s.finish_reason is None and self._budget(s) > 0]
        if live and not self.mtp:
            self._ngram([s for _, s in live])
        elif live and proposed is not None:   # drafted inside the verify step, from each lane's last kept row
            for i, s in live:
                s.drafts = proposed[i][:self._budget(s)]
            self._proposed([s for _, s in live])
        elif live:
            qs = np.cumsum([0] + [b - a for a, b in spans])
            idx = torch.tensor(np.concatenate([np.arange(qs[i], qs[i] + kept[i]) for i, _ in live]),
                               device=e.device)
            lanes = [s for _, s in live]
            # the pairs (h_t, token t+1) of every token the target kept, at the positions it ran them
            out = self._mtp(lanes, [(spans[i][0], spans[i][0] + kept[i]) for i, _ in live], normed.index_select(0, idx))
            ends = torch.tensor(np.cumsum([kept[i] for i, _ in live]) - 1, device=e.device)
            self._draft(lanes, out.index_select(0, ends))

    def _verify(self, seqs, spans):
        """Run the verify step: (the target's token at each lane's rows, the final-normed hidden of every row, the step
        when its commit is still to run (else None: no lane had drafts, or a static round committed on the device),
        each lane's next drafts when the step made them (else None), whether it was a VerifyStep (which also counted
        the committed tokens for the penalties)). A VerifyStep (replayed) when (with MTP) every lane has all K drafts
        and the positions it writes fit; else op by op."""
        e, cache = self.engine, self.engine.cache
        # the positions the step writes (its K + 1 rows; the MTP draft steps' K - 1 more), + 1: within what the lane
        # may ever hold (prompt + max_new, the pages a scheduler reserves for it), so near its end a lane's rounds run
        # op by op
        reach = [len(s.tokens) + (2 * self.k - 1 if self.mtp else self.k) for s in seqs]
        if self.static and all(
                (len(s.drafts) == self.k or not self.mtp) and r <= min(len(s.prompt) + s.max_new, cache.max_context)
                for s, r in zip(seqs, reach)) \
                and sum(self._new_pages(s, r - len(s.tokens)) for s, r in zip(seqs, reach)) <= cache.available_pages:
            for s, r in zip(seqs, reach):
                cache.grow(s.pages, r)
            vs = self.verify.get(len(seqs)) or self._verify_step(len(seqs))
            targets, drafts = vs.run(seqs)
            return targets, vs.normed, None, drafts, True
        ids, step, rows = e._inputs(seqs, spans, all_rows=True)
        pending = None
        if any(s.drafts for s in seqs):   # the GDN states read, not written (gdn_verify): the commit follows
            step.keep, step.commit = [], torch.zeros(len(seqs), dtype=torch.int32, device=e.device)
            pending = step
        logits, normed = e.model.forward(e.be, ids, step, rows, normed=True)
        picks, qs = self._picks(logits, seqs, spans).tolist(), np.cumsum([0] + [b - a for a, b in spans])
        return [picks[qs[i]:qs[i + 1]] for i in range(len(seqs))], normed, pending, None, False

    def _verify_step(self, b: int) -> VerifyStep:
        """The static round for b lanes, made on first use: captured as a CUDA graph where the engine captures its
        decode steps; should the capture fail, run uncaptured (the same results, launched op by op) and say so."""
        e = self.engine
        if self._row_counts is None:
            self._row_counts = torch.zeros(e.cache.max_seqs * (self.k + 1), e.cfg.vocab, dtype=torch.int32,
                                           device=e.device)
        try:
            vs = VerifyStep(e, b, self.k + 1, e.cuda_graphs, self._row_counts, self.draft if self.mtp else None)
        except Exception:
            if not e.cuda_graphs:
                raise
            log.exception("capturing the speculative round for %d lanes failed; it runs uncaptured", b)
            vs = VerifyStep(e, b, self.k + 1, False, self._row_counts, self.draft if self.mtp else None)
        self.verify[b] = vs
        return vs

    def _picks(self, logits, seqs, spans) -> torch.Tensor:
        """The target's token at every verify row: row i of a lane is drawn as plain decoding draws the lane's
        generated token n_generated + i (its counter; its penalty counts with the drafts before it)."""
        e = self.engine
        rows = [(s, i) for s, (a, b) in zip(seqs, spans) for i in range(b - a)]
        counts = None
        if any(s.sampling.presence_penalty or s.sampling.frequency_penalty for s in seqs):
            slots = torch.tensor([s.slot for s, _ in rows], dtype=torch.int32, device=e.device)
            counts = e._counts.index_select(0, slots)
            at = [(r, d) for r, (s, i) in enumerate(rows) for d in s.drafts[:i]]
            if at:
                r, d = zip(*at)
                counts.index_put_((torch.tensor(r, device=e.device), torch.tensor(d, device=e.device)),
                                  torch.ones(len(at), dtype=counts.dtype, device=e.device), accumulate=True)
        return e._choose(logits, [s for s, _ in rows], [s.n_generated + i for s, i in rows], counts)

    # -- the MTP layer ---------------------------------------------------------------------------------
    def _mtp(self, seqs, spans, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer over the pairs (hidden row, token t+1) at positions [a, b) of each sequence."""
        e = self.engine
        ids, step, _ = e._inputs(seqs, spans, shift=1)
        return e.model.mtp(e.be, ids, hidden, step)

    def draft(self, be, last: torch.Tensor, ids: torch.Tensor) -> None:
        """ids[i] = the draft from MTP output row i: the argmax over the shared lm_head, or over the draft vocabulary."""
        if self.draft_vocab is not None:
            self.draft_vocab.argmax(be, last, ids)
        else:
            be.run("argmax", logits=self.engine.model.logits(be, last), ids=ids, domain=self.engine.domain)

    def _draft(self, seqs, last: torch.Tensor) -> None:
        """Each sequence's drafts for its next round, from the MTP output of its last kept pair (rows of `last`):
        one argmax over the shared lm_head, then one MTP step per further draft."""
        e, lanes = self.engine, seqs
        budget = [self._budget(s) for s in seqs]
        for j in range(max(budget)):
            ids = torch.empty(last.shape[0], dtype=torch.int32, device=e.device)
            self.draft(e.be, last, ids)
            for s, tok in zip(seqs, ids.tolist()):
                s.drafts.append(tok)
            go = [i for i, k in enumerate(budget) if k > j + 1]
            if not go:
                break
            seqs, budget = [seqs[i] for i in go], [budget[i] for i in go]
            last = last.index_select(0, torch.tensor(go, device=e.device)) if len(go) < last.shape[0] else last
            # pair (the previous output, draft j) at the position after the last one (the draft's own position - 1)
            n = [len(s.tokens) + j for s in seqs]
            last = self._mtp(seqs, [(p - 1, p) for p in n], last)
        self._proposed(lanes)

    def _ngram(self, seqs) -> None:
        """Each sequence's drafts from its own n-grams (prompt lookup)."""
        c = self.config
        for s in seqs:
            if s.proposer is None:
                s.proposer = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)
            s.drafts = s.proposer.propose(s.tokens, self._budget(s))
        self._proposed(seqs)

    def _proposed(self, seqs) -> None:
        """The sequences' drafts for their next round are set (drafts_from hooks in here)."""

    def _budget(self, seq, spare: int | None = None) -> int:
        """Drafts a sequence's next round may verify: a round commits up to that many + 1 tokens, within max_new and
        the context, and its pages (positions up to len(tokens) - 1 + drafts) must be free to have (of `spare` pages:
        what the round's other lanes leave; default all available)."""
        cache = self.engine.cache
        spare = cache.available_pages if spare is None else spare
        k = min(self.k, seq.max_new - seq.n_generated - 1, cache.max_context - len(seq.tokens) - 1)
        while k > 0 and self._new_pages(seq, k) > spare:
            k -= 1
        return max(k, 0)

    def _new_pages(self, seq, k: int) -> int:
        """Pages a round with k drafts adds to the sequence's (its positions up to len(tokens) - 1 + k)."""
        return max(0, -(-(len(seq.tokens) + k) // self.engine.cache.page_size) - len(seq.pages))


@contextmanager
def drafts_from(known: dict, alter=None):
    """Within: a sequence whose prompt is a key of `known` (a tuple) gets its drafts from the tokens there (its known
    continuation), after the MTP layer ran (its cost, its KV), changed by alter(drafts) where given. Random weights
    reject the MTP layer's own drafts: this is how ninfer-bench spec measures rounds whose drafts hold, and how the
    tests drive acceptance and rollback."""
    real = Speculator._proposed

    def proposed(self, seqs):
        real(self, seqs)
        for s in seqs:
            full = known.get(tuple(s.prompt))
            if full is not None:
                s.drafts = list(full[len(s.tokens):len(s.tokens) + len(s.drafts)])
                if alter is not None:
                    alter(s.drafts)
    Speculator._proposed = proposed
    try:
        yield
    finally:
        Speculator._proposed = real
