"""The engine: load an artifact, plan memory, and generate for a batch of sequences.

Prefill runs in chunks (one sequence per step); decode runs every live sequence in one step, or, with speculative
decoding, in one verify round (speculative.py). All go through the model file of the artifact's family
on the chosen backend.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .artifact import open_artifact
from .cache import CapacityError, SequenceCache, kv_storage_dtype, plan_kv_pages
from .decode_graph import DecodeGraphs, count_tokens, seed32
from .dispatch import backend as make_backend
from .kv_dtype import KV_CACHE_DTYPES
from .models import MODELS
from .models.blocks import Step, dequant_scratch_bytes, prefill_workspace_bytes
from .models.config import HybridConfig, parse_config
from .speculative import SpeculativeConfig, Speculator
from .tokenizer import id_domain
from .weights import load_weights


class EngineError(ValueError):
    pass


def mtp_of(speculative: SpeculativeConfig | None) -> bool:
    """Whether the engine loads and runs the MTP layer."""
    return speculative is not None and speculative.method == "mtp"


def token_domain(art, vocab: int) -> int:
    """Ids the tokenizer can produce: real checkpoints pad the embedding past them (Qwen3.5: 248077 of
    248320 rows) and padded rows must never be chosen. A tokenizer covering under half the rows is not
    this model's (test fixtures), so then every row counts."""
    try:
        return id_domain(json.loads(art.resource("tokenizer.json")), vocab)
    except KeyError:
        return vocab


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling (the `sample` op's contract). temperature <= 0 is greedy."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def check(self) -> "SamplingParams":
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise EngineError("sampling: temperature >= 0, top_k >= 0, 0 < top_p <= 1 and 0 <= min_p <= 1 are required")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise EngineError("sampling: presence and frequency penalties must lie in [-2, 2]")
        return self


GREEDY = SamplingParams()

# Decode through the graphs keeps the next step in flight (Engine._decode_graphs); NINFER_DECODE_AHEAD=0 turns it
# off (A/B runs).
DECODE_AHEAD = os.environ.get("NINFER_DECODE_AHEAD", "1") == "1"


@dataclass
class Sequence:
    prompt: list[int]
    max_new: int
    stop_ids: frozenset
    sampling: SamplingParams = GREEDY
    seed: int = 0
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    prefilled: int = 0                                   # prompt tokens already run
    cached: int = 0                                      # prompt tokens taken from a retained lane (prefix cache)
    checkpointed: int = 0                                # of those, what the lane's checkpoint still covers
    snapshot_at: int = 0                                 # keep a prefix snapshot of the first this many tokens
    tokens: list[int] = field(default_factory=list)      # prompt + generated
    drafts: list[int] = field(default_factory=list)      # speculative decoding: tokens proposed after `tokens`
    proposer: object = None                              # its drafter's state for this sequence (an n-gram index)
    finish_reason: str | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def n_generated(self) -> int:
        """len(generated) without the copy: the per-step paths use it (a slice copies every token so far)."""
        return len(self.tokens) - len(self.prompt)


@dataclass
class _Ahead:
    """A decode step queued and not yet taken: its sequences (rows), graph and launch ticket."""
    seqs: list
    graph: object
    ticket: int


FP8_KV_OPS = ("kv_cache_write_fp8", "paged_attention_fp8", "paged_attention_split_fp8")   # kv_cache_dtype fp8


class Engine:
    def __init__(self, artifact_path, *, backend: str = "auto", max_context: int = 4096, max_seqs: int = 8,
                 page_size: int = 16, prefill_chunk: int = 4096, kv_capacity: str | int = "auto",
                 cuda_graphs: bool = True, packed_weights: bool | None = None, kv_cache_dtype: str = "auto",
                 prefix_caching: bool = False, prefix_snapshots: int = 0, cache_ram_bytes: int = 0,
                 speculative: SpeculativeConfig | None = None):
        """packed_weights: keep q4/q5/q6/w8/fp8 matrices packed (the packed ops decode them on the fly).
        Default: on the cuda backend; the reference backend decodes them once at load (its packed ops would
        re-decode every matrix at every step: a CPU demo would crawl).
        speculative: decode speculatively, drafts from the artifact's MTP layer or n-grams of the sequence (speculative.py)."""
        be = make_backend(backend)
        self.art = open_artifact(artifact_path)
        try:
            cfg = parse_config(self.art.resource("config.json"))
            device = torch.device("cuda" if be.name == "cuda" else "cpu")
            # The reference backend computes in fp32 (the CPU oracle path); the generated kernels in bf16.
            packed = be.name == "cuda" if packed_weights is None else packed_weights
            weights = load_weights(self.art, device, torch.bfloat16 if be.name == "cuda" else torch.float32, packed,
                                   mtp=mtp_of(speculative),
                                   draft_head=mtp_of(speculative) and speculative.draft_vocab_size is not None)
            self._setup(be, cfg, weights, token_domain(self.art, cfg.vocab), max_context=max_context,
                        max_seqs=max_seqs, page_size=page_size, prefill_chunk=prefill_chunk,
                        kv_capacity=kv_capacity, cuda_graphs=cuda_graphs, kv_cache_dtype=kv_cache_dtype,
                        prefix_caching=prefix_caching, prefix_snapshots=prefix_snapshots,
                        cache_ram_bytes=cache_ram_bytes, speculative=speculative)
        except BaseException:
            self.art.close()
            raise

    @classmethod
    def from_weights(cls, cfg: HybridConfig, weights: dict, *, backend: str = "auto", domain: int | None = None,
                     **options) -> "Engine":
        """An engine over weights already in memory (synthetic-weight benchmarks at real shapes)."""
        self = cls.__new__(cls)
        self.art = None
        self._setup(make_backend(backend), cfg, weights, domain or cfg.vocab, **options)
        return self

    def _setup(self, be, cfg: HybridConfig, weights: dict, domain: int, *, max_context: int = 4096,
               max_seqs: int = 8, page_size: int = 16, prefill_chunk: int = 4096, kv_capacity: str | int = "auto",
               cuda_graphs: bool = True, kv_cache_dtype: str = "auto", prefix_caching: bool = False,
               prefix_snapshots: int = 0, cache_ram_bytes: int = 0,
               speculative: SpeculativeConfig | None = None) -> None:
        if prefill_chunk < 1 or max_context < 1 or not 1 <= max_seqs <= 8:
            raise EngineError("prefill_chunk and max_context must be >= 1 and max_seqs within 1..8")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        prefill_chunk = min(prefill_chunk, max_context)   # no chunk holds more (the memory plan reserves for it)
        if cfg.family not in MODELS:
            raise EngineError(f"no model file for family {cfg.family!r} (have: {', '.join(MODELS)})")
        mtp = mtp_of(speculative)
        if mtp and "mtp.fc" not in weights:
            raise EngineError(f"speculative method {speculative.method!r} needs the checkpoint's MTP layer (mtp.*), "
                              f"which this artifact does not carry (convert it without --skip mtp)")
        self.be, self.cfg, self.weights, self.domain = be, cfg, weights, domain
        self.device = torch.device("cuda" if be.name == "cuda" else "cpu")
        self.dtype = torch.bfloat16 if be.name == "cuda" else torch.float32
        MODELS[cfg.family].fuse_weights(cfg, weights)
        scratch = dequant_scratch_bytes(weights) + prefill_workspace_bytes(be, cfg, prefill_chunk, max_seqs)
        kv_dtype = kv_storage_dtype(kv_cache_dtype, self.dtype)
        self.kv_cache_dtype = "fp8_e4m3" if kv_dtype == torch.uint8 else "auto"
        missing = [op for op in FP8_KV_OPS if not be.has_op(op)] if kv_dtype == torch.uint8 else []
        if missing:
            raise EngineError(f"kv_cache_dtype {kv_cache_dtype!r} needs {', '.join(missing)}, which have no kernels "
                              f"for this GPU ({be.device.arch}; the E4M3 conversions need sm_89 or newer): use 'auto'")
        num_pages = plan_kv_pages(cfg, self.device, kv_dtype, max_seqs, max_context, page_size, prefill_chunk,
                                  kv_capacity, scratch, prefix_caching, prefix_snapshots, mtp)
        self.cache = SequenceCache(cfg, max_seqs=max_seqs, max_context=max_context, page_size=page_size,
                                   device=self.device, dtype=self.dtype, num_pages=num_pages, kv_dtype=kv_dtype,
                                   prefix_caching=prefix_caching, prefix_snapshots=prefix_snapshots,
                                   cache_ram_bytes=cache_ram_bytes, mtp=mtp)
        try:
            self.model = MODELS[cfg.family](cfg, weights, self.cache)
        except KeyError as e:
            raise EngineError(f"the artifact lacks tensor {e.args[0]!r}, which the {cfg.family} model needs") from None
        # generated-token counts per lane (+ the scratch lane graphs warm up on), for the sample op's penalties
        self._counts = torch.zeros(max_seqs + 1, cfg.vocab, dtype=torch.int32, device=self.device)
        self.prefill_chunk = prefill_chunk
        self.cuda_graphs = be.name == "cuda" and cuda_graphs
        # decode steps captured at start-up; a speculative engine decodes through its rounds (captured on first use)
        self.graphs = DecodeGraphs(self) if self.cuda_graphs and speculative is None else None
        self._ahead: _Ahead | None = None   # a decode step queued for the next decode call (_decode_graphs)
        self.spec = Speculator(self, speculative) if speculative is not None else None

    # -- steps -----------------------------------------------------------------------------------
    def _step(self, seqs: list[Sequence], spans: list[tuple[int, int]], all_rows: bool = False,
              hidden_out: list | None = None, normed: bool = False):
        """Run tokens [a, b) of each sequence; return the logits of each sequence's last token
        (of every token with all_rows), and with `normed` the final-normed hidden of every token."""
        ids, step, rows = self._inputs(seqs, spans, all_rows)
        return self.model.forward(self.be, ids, step, rows, hidden_out, normed)

    def _inputs(self, seqs: list[Sequence], spans: list[tuple[int, int]], all_rows: bool = False, shift: int = 0):
        """(ids, Step, logits rows) of a step over positions [a, b) of each sequence, its pages grown to cover
        them; the ids are the tokens `shift` places on (tokens past the sequence's are its drafts)."""
        for seq, (a, b) in zip(seqs, spans):
            self.cache.grow(seq.pages, b)
        ids, positions, token_seq, slot_mapping, qs, slots, rows, table = self._step_inputs(seqs, spans, all_rows, shift)
        step = Step(positions=positions, token_seq=token_seq, query_start=qs, slot_mapping=slot_mapping,
                    block_table=table, state_slots=slots, decode=all(b - a == 1 for a, b in spans))
        return ids, step, rows

    def _step_inputs(self, seqs: list[Sequence], spans: list[tuple[int, int]], all_rows: bool,
                     shift: int = 0) -> list[torch.Tensor]:
        """The step's int32 inputs (ids, positions, token_seq, slot_mapping, query_start, state_slots, logits rows,
        block_table), built with numpy in one host buffer and sent in one copy: Python lists cost ~2.5 ms at 8K
        tokens, and a blocking copy per tensor drained the stream before every prefill chunk. The host buffer is
        pinned and the copy asynchronous (torch keeps the buffer until the copy is done)."""
        ps, n_seq = self.cache.page_size, len(seqs)
        qs = np.cumsum([0] + [b - a for a, b in spans], dtype=np.int32)
        T, width = int(qs[-1]), max(len(seq.pages) for seq in seqs)
        sizes = [T, T, T, T, n_seq + 1, n_seq, T if all_rows else n_seq, n_seq * width]
        starts = np.cumsum([0] + [-(-n // 4) * 4 for n in sizes])   # each part 16-byte aligned (the kernels' rule)
        host = torch.zeros(int(starts[-1]), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        buf = host.numpy()
        part = [buf[s:s + n] for s, n in zip(starts, sizes)]
        ids, positions, token_seq, slot_mapping, query_start, slots, rows, table = part
        query_start[:], table = qs, table.reshape(n_seq, width)
        for s, (seq, (a, b)) in enumerate(zip(seqs, spans)):
            o = slice(qs[s], qs[s + 1])
            fed = seq.tokens[a + shift:b + shift]
            if len(fed) < b - a:   # positions past the tokens hold the drafts (a verify step, an MTP draft step)
                d = max(0, a + shift - len(seq.tokens))
                fed = fed + seq.drafts[d:d + b - a - len(fed)]
            ids[o] = np.fromiter(fed, dtype=np.int32, count=b - a)
            positions[o] = np.arange(a, b, dtype=np.int32)
            token_seq[o] = s
            pages = np.array(seq.pages, dtype=np.int32)
            slot_mapping[o] = pages[positions[o] // ps] * ps + positions[o] % ps
            table[s, :len(pages)] = pages
            slots[s] = seq.slot
        rows[:] = np.arange(T, dtype=np.int32) if all_rows else qs[1:] - 1
        dev = host.to(self.device, non_blocking=True)
        out = [dev[s:s + n] for s, n in zip(starts, sizes)]
        out[7] = out[7].view(n_seq, width)
        return out

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Each sequence's next token from its logits row, counted for the penalties (as the decode graph does)."""
        ids = self._choose(logits, seqs, [s.n_generated for s in seqs])
        count_tokens(self._counts, torch.tensor([s.slot for s in seqs], dtype=torch.int32, device=self.device), ids)
        return ids.tolist()

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], counters: list[int],
                counts: torch.Tensor | None = None) -> torch.Tensor:
        """The token of each logits row (device i32), row r drawn for seqs[r] with its sampling params, its sampler's
        counter counters[r] (the generated index the token will have: the draw of a (seed, counter) pair is fixed)
        and penalty counts counts[r] (default: its lane's generated tokens); the argmax op when every row is greedy
        without penalties."""
        ids = torch.empty(logits.shape[0], dtype=torch.int32, device=self.device)
        if all(s.sampling.temperature <= 0 and not s.sampling.presence_penalty and not s.sampling.frequency_penalty
               for s in seqs):
            self.be.run("argmax", logits=logits, ids=ids, domain=self.domain)
            return ids
        f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=self.device)  # noqa: E731
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=self.device)  # noqa: E731
        if counts is None:
            counts = self._counts.index_select(0, i32([s.slot for s in seqs]))
        sp = [s.sampling for s in seqs]
        self.be.run("sample", logits=logits, counts=counts,
                    temperature=f32([p.temperature for p in sp]), top_k=i32([p.top_k for p in sp]),
                    top_p=f32([p.top_p for p in sp]), min_p=f32([p.min_p for p in sp]),
                    presence=f32([p.presence_penalty for p in sp]), frequency=f32([p.frequency_penalty for p in sp]),
                    seed=i32([seed32(s.seed) for s in seqs]),
                    counter=i32(counters), ids=ids, domain=self.domain)
        return ids

    def _accept(self, seq: Sequence, token: int) -> None:
        seq.tokens.append(token)   # (its count for the penalties is added on the device: _pick, a round's commit)
        if token in seq.stop_ids:
            seq.finish_reason = "stop"
        elif seq.n_generated >= seq.max_new or len(seq.tokens) >= self.cache.max_context:
            seq.finish_reason = "length"

    # -- generation ------------------------------------------------------------------------------
    # -- the step API a scheduler drives: open -> prefill (chunk by chunk) -> decode (batched) -> release --
    def open(self, prompt: list[int], *, max_new: int = 128, stop_ids=(), sampling: SamplingParams = GREEDY,
             snapshot_at: int = 0) -> Sequence:
        """Validate and admit one request and give it a lane (raises EngineError/CapacityError, holding nothing).
        snapshot_at: keep a prefix snapshot of the prompt's first this many tokens (when the engine keeps them)."""
        if max_new < 0:
            raise EngineError(f"max_new must be >= 0, got {max_new}")
        self._validate(prompt)
        self.cache.admit(len(prompt) + (1 if max_new > 0 else 0))  # generation stops at the context limit
        sampling.check()
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
        seq = Sequence(list(prompt), max_new, frozenset(stop_ids), sampling, seed, tokens=list(prompt))
        hit = self.cache.take_prefix(seq.prompt) if self.cache.prefix_caching else None
        if hit is not None:
            seq.slot, seq.pages, seq.prefilled, seq.checkpointed = hit
        else:
            seq.slot = self.cache.open_slot()
            seq.prefilled = self.cache.take_snapshot(seq.prompt, seq.slot, seq.pages)
        seq.cached = seq.prefilled
        keeps = bool(self.cache.snapshot_states)   # else no chunk is cut at the snapshot point
        seq.snapshot_at = snapshot_at if keeps and seq.prefilled < snapshot_at < len(seq.prompt) else 0
        self._counts[seq.slot].zero_()
        return seq

    def prefill(self, seq: Sequence, max_tokens: int | None = None) -> bool:
        """Run the next prompt chunk (prefill_chunk tokens, or fewer when max_tokens says so); after the last one,
        choose the first token. True when prefill is done."""
        t0 = time.perf_counter()
        n, a = len(seq.prompt), seq.prefilled
        b = min(a + min(max_tokens or self.prefill_chunk, self.prefill_chunk), n)
        if a < seq.snapshot_at < b:   # the chunk ends where the snapshot is to be taken
            b = seq.snapshot_at
        normed = None
        if a == n:   # the whole prompt is cached, its last token's logits with it (SequenceCache.take_prefix)
            logits = self.cache.checkpoint_logits[seq.slot:seq.slot + 1].clone()   # a fresh, aligned row
        elif self.spec is not None and self.spec.mtp:   # the MTP layer reads the chunk's final-normed hidden
            logits, normed = self._step([seq], [(a, b)], normed=True)
        else:
            logits = self._step([seq], [(a, b)])
        seq.prefilled = b
        if b == seq.snapshot_at:
            self.cache.snapshot(seq.slot, seq.pages, seq.prompt[:b])
        if b == n:
            if self.cache.prefix_caching and a < n:
                self.cache.checkpoint(seq.slot, logits[0], n)
            if seq.max_new > 0:
                self._accept(seq, self._pick(logits, [seq])[0])
            else:
                seq.finish_reason = "length"
        if self.spec is not None:
            self.spec.after_prefill(seq, a, b, normed)
        seq.prefill_s += time.perf_counter() - t0
        if b == n:
            seq.ttft_s = seq.prefill_s
        return b == n

    def decode(self, seqs: list[Sequence]) -> None:
        """One decode step for every given sequence (prefilled, unfinished): each gets one more token, or with
        speculative decoding one to K+1 (a round). Through the decode graphs the next step is already queued when this
        returns (_decode_graphs)."""
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.round(seqs)
        elif self.graphs is not None:
            self._decode_graphs(seqs)
        else:
            picked = self._pick(self._step(seqs, [(len(s.tokens) - 1, len(s.tokens)) for s in seqs]), seqs)
            for seq, tok in zip(seqs, picked):
                self._accept(seq, tok)
        dt = time.perf_counter() - t0
        for seq in seqs:
            seq.decode_s += dt

    def _decode_graphs(self, seqs: list[Sequence]) -> None:
        """decode() through the captured graphs with one step kept in flight: once a step is queued, the step after
        it is queued too (its rows fed on the device by the first one's ids, DecodeGraphs' launch ahead), so the
        host's work between calls (the caller's, and this call's bookkeeping) overlaps the GPU. A call that names
        the same sequences in the same order as the step in flight takes its ids; any other call takes them for
        whichever of its sequences are still open (their state has advanced already: a sequence left out still
        gets its token), and the rest get a step of their own."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and len(ahead.seqs) == len(seqs) and all(a is b for a, b in zip(ahead.seqs, seqs)) \
                and self._room(seqs, 2):
            self._grow(seqs, 1)
            k = ahead.graph.launch(seqs, ahead=True)
            self._take(ahead)
            self._ahead = _Ahead(list(seqs), ahead.graph, k)
            return
        done = self._take(ahead) if ahead is not None else set()
        rest = [s for s in seqs if id(s) not in done]
        if rest:
            self._grow(rest, 0)
            for seq, tok in zip(rest, self.graphs.run(rest)):
                self._accept(seq, tok)
        live = [s for s in seqs if s.finish_reason is None]
        if DECODE_AHEAD and live and self._room(live, 1):
            self._grow(live, 0)
            graph = self.graphs.graphs[len(live)]
            self._ahead = _Ahead(live, graph, graph.launch(live))

    def _take(self, ahead: "_Ahead") -> set[int]:
        """Accept a queued step's ids for its sequences that are still open (neither released nor finished);
        returns id() of those."""
        done = set()
        for seq, tok in zip(ahead.seqs, ahead.graph.collect(ahead.ticket)):
            if seq.slot is not None and seq.finish_reason is None:
                self._accept(seq, tok)
                done.add(id(seq))
        return done

    def _room(self, seqs: list[Sequence], n: int) -> bool:
        """Every sequence can take n more tokens, and the pool has the pages for the positions up to the n-th
        (a step queued ahead writes one position past the token in flight)."""
        ps = self.cache.page_size
        pages = sum(max(0, -(-(len(s.tokens) + n - 1) // ps) - len(s.pages)) for s in seqs)
        return pages <= self.cache.available_pages and all(
            s.n_generated + n <= s.max_new and len(s.tokens) + n <= self.cache.max_context for s in seqs)

    def _grow(self, seqs: list[Sequence], ahead: int) -> None:
        for seq in seqs:   # the fed token's position, `ahead` past the last accepted one
            self.cache.grow(seq.pages, len(seq.tokens) + ahead)

    def release(self, seq: Sequence, retain: bool = True) -> None:
        """Return the sequence's lane and KV pages to the pool (idempotent; call it however the request ended).
        With prefix caching, a sequence whose prompt was run keeps its lane retained (given back on demand)
        unless retain is False (a failed step may have left its state half-written); one released before its prompt
        was run (cancelled) keeps the prefix its lane's checkpoint still covers (the checkpoint and those KV
        positions are intact)."""
        partial = seq.prefilled < len(seq.prompt)
        if seq.slot is None or not retain or not self.cache.prefix_caching or (partial and not seq.checkpointed):
            if seq.slot is not None or seq.pages:
                self.cache.release(seq.slot, seq.pages)
                seq.slot = None
            return
        if partial:   # its own state is part-way into the rest of the prompt
            self.cache.retain(seq.slot, seq.prompt[:seq.checkpointed], seq.checkpointed, False, seq.pages)
        else:
            # the lane's state has fed every token but the last one picked, and that one too when a step queued
            # ahead (Engine._decode_graphs) holds it: that step runs before anything later on the stream
            ahead = self._ahead is not None and any(s is seq for s in self._ahead.seqs)
            fed = len(seq.tokens) - (1 if seq.n_generated and not ahead else 0)
            self.cache.retain(seq.slot, seq.tokens[:fed], len(seq.prompt), True, seq.pages)
        seq.slot = None

    # -- lane images (ninfer-serve --slot-save-path, llama.cpp's slot save / restore) --------------------------
    @property
    def model_digest(self) -> str:
        """What a saved lane image must have been saved from: the artifact's payload digest."""
        return self.art.payload_sha256 if self.art is not None else f"in-memory-weights-{id(self.weights)}"

    def lane_image(self, slot: int) -> tuple[dict, dict]:
        """A retained lane's KV pages and GDN states as host tensors, and its tokens (lane_image.write_lane_image
        saves them); KeyError when the lane holds no finished prompt."""
        tensors, meta = self.cache.export_lane(slot)
        return tensors, {**meta, "model": self.model_digest}

    def restore_lane(self, slot: int, tensors: dict, meta: dict) -> int:
        """Make lane `slot` a retained lane holding an image (lane_image.read_lane_image); returns its tokens.
        ValueError when it is not an image of this model's cache; CapacityError when the lane is running or pages
        are short."""
        if meta.get("model") != self.model_digest:
            raise ValueError("the image was saved from another model")
        if not self.cache.prefix_caching:
            raise ValueError("lane images need prefix caching (its checkpoints)")
        self.cache.import_lane(slot, tensors, meta)
        return len(meta["tokens"])

    def generate(self, prompts: list[list[int]], *, max_new: int = 128, stop_ids=(),
                 sampling: SamplingParams | list[SamplingParams] = GREEDY) -> list[Sequence]:
        """Generate for a batch of prompts; each sequence's tokens depend only on its own prompt, sampling
        params and seed (a batch gives the same tokens as each prompt alone)."""
        if not prompts or len(prompts) > self.cache.max_seqs:
            raise EngineError(f"give 1..{self.cache.max_seqs} prompts, got {len(prompts)}")
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise EngineError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for p, sp in zip(prompts, params):  # refuse any bad request before taking lanes
            self._validate(p)
            self.cache.admit(len(p) + (1 if max_new > 0 else 0))
            sp.check()
        seqs = []
        try:
            for p, sp in zip(prompts, params):
                seqs.append(self.open(p, max_new=max_new, stop_ids=stop_ids, sampling=sp))
            for seq in seqs:
                while not self.prefill(seq):
                    pass
            while live := [s for s in seqs if s.finish_reason is None]:
                self.decode(live)
        finally:
            for seq in seqs:
                self.release(seq)
        return seqs

    def score(self, ids: list[int], *, hidden_out: list | None = None) -> torch.Tensor:
        """Logits [len(ids), V] at every position of one sequence (chunked prefill): perplexity, KL, tests.
        With hidden_out, the residual stream after each layer is appended to it (one [n, H] per layer)."""
        self._validate(ids)
        self.cache.admit(len(ids))
        seq = Sequence(list(ids), 0, frozenset(), tokens=list(ids))
        out, per_layer = [], []
        try:
            seq.slot = self.cache.open_slot()
            for a in range(0, len(ids), self.prefill_chunk):
                got = [] if hidden_out is not None else None
                out.append(self._step([seq], [(a, min(a + self.prefill_chunk, len(ids)))], True, got))
                per_layer.append(got)
        finally:
            self.cache.release(seq.slot, seq.pages)
        if hidden_out is not None:
            hidden_out.extend(torch.cat(layer, 0) for layer in zip(*per_layer))
        return torch.cat(out, 0)

    def _validate(self, ids: list[int]) -> None:
        if not ids:
            raise EngineError("empty prompt: at least one token is needed")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.domain]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary (valid ids: 0..{self.domain - 1})")

    def close(self) -> None:
        """Drop the weights (CPU weights may be views of the artifact's mapping), then close the artifact."""
        self.model = self.weights = self.graphs = self._ahead = self.spec = None
        if self.art is not None:
            self.art.close()
            self.art = None


__all__ = ["Engine", "EngineError", "CapacityError", "Sequence", "SamplingParams", "GREEDY"]

