"""Sequence state memory, planned once at start-up: a paged KV pool per attention layer (pages shared
by all sequences through per-sequence page lists) and a GDN conv/recurrent state slot per sequence.

A request that could never fit is refused before it starts; pages and slots go back to the pool when
a sequence ends, whatever ended it.

Prefix caching (optional): the GDN state cannot be rewound, so each lane keeps a checkpoint of its state at
the end of its prompt. A finished sequence's lane stays retained with its KV pages and two states: the
checkpoint (its prompt) and the lane's own (its prompt and the tokens it generated and fed). A later prompt
that extends either takes the lane over and prefills only the rest: a chat's next turn extends the prompt (the
template renders turn n + 1 as turn n's prompt plus the answer, its reasoning dropped, and the new message); a
tool loop's next call can extend the whole generation (reasoning of the current turn is kept). The logits of the
prompt's last token are kept with the checkpoint, so the same prompt again (a retry, a regenerated answer) runs
nothing before its first token. Retained lanes and pages are given back, oldest first, whenever a lane or pages are
wanted.

Host RAM (optional, llama.cpp's --cache-ram): a retained lane given back for its lane or pages is first copied to
host memory (export_lane's image) within a byte budget, oldest images dropped first; a later prompt that one of them
serves further than any retained lane brings it back into a lane (import_lane) before the lane is taken. Many more
conversations than lanes then keep their prefixes.

Speculative decoding: a verify step reads its lanes' GDN states and writes none (gdn_verify with commit 0); the
round's commit advances them over the tokens each lane kept. With MTP drafts, the MTP layer's KV lives in the same
pages (key "mtp" of `kv`).

Prefix snapshots: a prompt may name a position to snapshot (the server names the end of its first turn, the
system prompt and tool list that a new conversation repeats). The KV of the tokens before it is copied into pages
of the snapshot's own and the GDN state into one of a few snapshot slots; a later prompt that starts with those
tokens, in any lane, gets copies of both. Snapshot pages are given back, oldest first, when pages are wanted and
no retained lane is left to give.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .models.config import HybridConfig


class CapacityError(RuntimeError):
    """The request cannot fit the planned memory (context too long, or no free lane/pages)."""


def kv_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the KV pool of a --kv-cache-dtype value (kv_dtype.py) is allocated in (uint8: E4M3 codes)."""
    return dtype if kv_cache_dtype == "auto" else torch.uint8


@dataclass
class Retained:
    """A finished sequence's lane kept for prefix caching: `pages` hold the KV of `tokens`; the slot's checkpoint
    holds the state after tokens[:checkpointed], the slot's own state the state after all of them when `live`."""
    tokens: list[int]
    checkpointed: int
    live: bool
    pages: list[int]

    def anchors(self):
        """(tokens covered, by the lane's own state) of each state a next prompt can start from."""
        return ([(len(self.tokens), True)] if self.live else []) + [(self.checkpointed, False)]


@dataclass
class HostLane:
    """A retained lane's image in host memory (export_lane): its tensors, metadata and bytes."""
    tensors: dict
    meta: dict
    nbytes: int

    @property
    def held(self) -> Retained:
        """What the image holds, as the retained lane it was (without pages)."""
        return Retained(self.meta["tokens"], self.meta["checkpointed"], self.meta["live"], [])


@dataclass
class Snapshot:
    """A prompt prefix kept for any later prompt that starts with it: the KV of `tokens` in `pages`, the GDN state
    after them in snapshot slot `index`."""
    tokens: list[int]
    pages: list[int]
    index: int


class SequenceCache:
    def __init__(self, cfg: HybridConfig, *, max_seqs: int, max_context: int, page_size: int, device,
                 dtype: torch.dtype, num_pages: int | None = None, kv_dtype: torch.dtype | None = None,
                 prefix_caching: bool = False, prefix_snapshots: int = 0, cache_ram_bytes: int = 0,
                 mtp: bool = False):
        self.cfg, self.page_size, self.max_context, self.max_seqs = cfg, page_size, max_context, max_seqs
        self.device = torch.device(device)
        self.pages_per_seq = -(-max_context // page_size)
        self.num_pages = num_pages or max_seqs * self.pages_per_seq
        shape = (self.num_pages, page_size, cfg.kv_heads, cfg.head_dim)
        kv_dtype = kv_dtype or dtype   # uint8: E4M3 codes (code 0 is 0.0)
        self.kv = {i: (torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
                   for i in range(cfg.layers) if cfg.is_attention(i)}
        if mtp:   # the MTP layer's own KV (speculative decoding), in the same pages
            self.kv["mtp"] = (torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
        # slot max_seqs is scratch for padding rows; real sequences use 0..max_seqs-1
        self.gdn = {i: (torch.zeros(max_seqs + 1, cfg.conv_channels, cfg.conv_width - 1, dtype=dtype, device=device),
                        torch.zeros(max_seqs + 1, cfg.v_heads, cfg.k_dim, cfg.v_dim, dtype=torch.float32, device=device))
                    for i in range(cfg.layers) if not cfg.is_attention(i)}
        # prefix caching: each lane's state at the end of its prompt, and the retained lanes (oldest first)
        self.prefix_caching = prefix_caching
        self.checkpoints = {i: (conv[:max_seqs].clone(), state[:max_seqs].clone())
                            for i, (conv, state) in self.gdn.items()} if prefix_caching else {}
        # the logits of each checkpoint's last token (a row of the model's dtype), and the tokens they follow
        self.checkpoint_logits = torch.zeros(max_seqs if prefix_caching else 0, cfg.vocab, dtype=dtype, device=device)
        self.logits_after: dict[int, int] = {}
        self.retained: dict[int, Retained] = {}
        # images of retained lanes given back, in host memory (oldest first), within cache_ram_bytes
        self.cache_ram_bytes = cache_ram_bytes if prefix_caching else 0
        self.host_lanes: list[HostLane] = []
        # prefix snapshots (oldest first) and their GDN state slots
        self.snapshot_states = {i: (conv[:prefix_snapshots].clone(), state[:prefix_snapshots].clone())
                                for i, (conv, state) in self.gdn.items()} if prefix_snapshots else {}
        self.snapshots: dict[tuple, Snapshot] = {}
        self.free_snapshot_slots = list(range(prefix_snapshots))
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        self.free_slots = list(range(max_seqs - 1, -1, -1))

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for pair in (*self.kv.values(), *self.gdn.values(), *self.checkpoints.values(),
                                *self.snapshot_states.values(), (self.checkpoint_logits,))
                   for t in pair)

    def admit(self, total_tokens: int) -> None:
        """Refuse up front what could never fit, whatever else is running."""
        if total_tokens > self.max_context:
            raise CapacityError(f"the request needs {total_tokens} tokens of context; the maximum is {self.max_context}")
        if -(-total_tokens // self.page_size) > self.num_pages:
            raise CapacityError(f"the request needs {-(-total_tokens // self.page_size)} KV pages; the pool has {self.num_pages}")

    def open_slot(self) -> int:
        if not self.free_slots and self.retained:
            self._evict()
        if not self.free_slots:
            raise CapacityError(f"all {self.max_seqs} sequence lanes are busy")
        slot = self.free_slots.pop()
        for conv, state in self.gdn.values():  # a new sequence starts from zero state
            conv[slot].zero_()
            state[slot].zero_()
        return slot

    def grow(self, pages: list[int], tokens: int) -> None:
        """Make `pages` cover `tokens` positions, taking pages from the pool."""
        need = -(-tokens // self.page_size) - len(pages)
        if not self._reclaim(need):
            raise CapacityError(f"out of KV pages: need {need} more, {len(self.free_pages)} free")
        for _ in range(max(need, 0)):
            pages.append(self.free_pages.pop())

    def release(self, slot: int | None, pages: list[int]) -> None:
        if slot is not None:
            self.free_slots.append(slot)
        self.free_pages.extend(reversed(pages))
        pages.clear()

    # -- prefix caching --------------------------------------------------------------------------------
    def checkpoint(self, slot: int, logits: torch.Tensor, tokens: int) -> None:
        """Keep the slot's state at the end of its prompt of `tokens` tokens, and the logits of its last token (a
        [vocab] row), for prefix caching."""
        _copy_states(self.checkpoints, slot, self.gdn, slot)
        self.checkpoint_logits[slot].copy_(logits)
        self.logits_after[slot] = tokens

    def retain(self, slot: int, tokens: list[int], checkpointed: int, live: bool, pages: list[int]) -> None:
        """Keep a finished sequence's lane: the KV pages of `tokens` (the rest go back to the pool), its checkpoint
        of tokens[:checkpointed], and (live) its own state after all of `tokens`."""
        keep = -(-len(tokens) // self.page_size)
        self.free_pages.extend(reversed(pages[keep:]))
        self.retained[slot] = Retained(list(tokens), checkpointed, live, pages[:keep])
        pages.clear()

    def take_prefix(self, prompt: list[int]) -> tuple[int, list[int], int, int] | None:
        """The retained state covering the most tokens that `prompt` extends (by at least one token, whose logits
        the caller needs, or by none where a checkpoint of the whole prompt kept them: checkpoint_logits): (slot,
        the KV pages, the tokens they hold, the tokens the slot's checkpoint covers), the slot's state restored from
        its checkpoint where that is the state taken; None when there is none."""
        self._from_host(prompt)
        best = self._best_retained(prompt)
        if best is None:
            return None
        n, live, slot = best
        r = self.retained.pop(slot)
        keep = -(-n // self.page_size)
        self.free_pages.extend(reversed(r.pages[keep:]))
        if not live:
            _copy_states(self.gdn, slot, self.checkpoints, slot)
        return slot, r.pages[:keep], n, r.checkpointed

    def _best_retained(self, prompt: list[int]) -> tuple[int, bool, int] | None:
        """(tokens covered, by the lane's own state, slot) of the retained state that serves `prompt` furthest."""
        return max(((n, live, s) for s, r in self.retained.items() for n, live in r.anchors()
                    if _serves(prompt, r.tokens, n, live, self.logits_after.get(s) == n)), default=None)

    def snapshot(self, slot: int, pages: list[int], tokens: list[int]) -> bool:
        """Keep a copy of a running lane's first len(tokens) positions (its state is after them now): KV into pages of
        the snapshot's own, taken only from free pages and retained lanes; the GDN state into a snapshot slot, the
        oldest snapshot's when none is free. False when it is kept already or the pages cannot be had."""
        key = tuple(tokens)
        if not self.snapshot_states or key in self.snapshots:
            return False
        need = -(-len(tokens) // self.page_size)
        if not self._reclaim(need, snapshots=False):
            return False
        if not self.free_snapshot_slots:
            self._drop_snapshot()
        own = [self.free_pages.pop() for _ in range(need)]
        self._copy_pages(pages[:need], own)
        index = self.free_snapshot_slots.pop()
        _copy_states(self.snapshot_states, index, self.gdn, slot)
        self.snapshots[key] = Snapshot(list(tokens), own, index)
        return True

    def take_snapshot(self, prompt: list[int], slot: int, pages: list[int]) -> int:
        """Start a fresh lane from the longest snapshot that `prompt` extends by at least one token: its KV copied
        into `pages` (grown to cover it) and its GDN state into the slot. Returns the tokens it covers (0: none)."""
        snap = max((s for s in self.snapshots.values()
                    if len(s.tokens) < len(prompt) and prompt[:len(s.tokens)] == s.tokens),
                   key=lambda s: len(s.tokens), default=None)
        if snap is None:
            return 0
        key = tuple(snap.tokens)
        del self.snapshots[key]   # not given back while its pages are wanted here; then the most recently used
        try:
            self.grow(pages, len(snap.tokens))
        except CapacityError:
            return 0
        finally:
            self.snapshots[key] = snap
        self._copy_pages(snap.pages, pages[:len(snap.pages)])
        _copy_states(self.gdn, slot, self.snapshot_states, snap.index)
        return len(snap.tokens)

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole KV pages src[j] -> dst[j] in every attention layer."""
        if not src:
            return
        idx = torch.tensor(src + dst)
        if self.device.type == "cuda":   # asynchronous, as the step inputs are: no stream drain mid-prefill
            idx = idx.pin_memory().to(self.device, non_blocking=True)
        s, d = idx[:len(src)], idx[len(src):]
        for k, v in self.kv.values():
            k[d] = k[s]
            v[d] = v[s]

    def _drop_snapshot(self) -> None:
        key, snap = next(iter(self.snapshots.items()))
        del self.snapshots[key]
        self.free_pages.extend(reversed(snap.pages))
        self.free_snapshot_slots.append(snap.index)

    # -- lane images (ninfer-serve --slot-save-path) -------------------------------------------------------
    def export_lane(self, slot: int) -> tuple[dict, dict]:
        """A retained lane as host tensors (its KV pages, its checkpoint and the logits kept with it, its own state
        when live) and metadata; KeyError when the slot holds no retained lane."""
        r = self.retained[slot]
        idx = torch.tensor(r.pages, device=self.device)
        out = {}
        for i, (k, v) in self.kv.items():
            out[f"kv.{i}.k"], out[f"kv.{i}.v"] = _host(k[idx]), _host(v[idx])
        for i, (conv, state) in self.gdn.items():
            out[f"gdn.{i}.checkpoint.conv"] = _host(self.checkpoints[i][0][slot])
            out[f"gdn.{i}.checkpoint.state"] = _host(self.checkpoints[i][1][slot])
            if r.live:
                out[f"gdn.{i}.conv"], out[f"gdn.{i}.state"] = _host(conv[slot]), _host(state[slot])
        if self.logits_after.get(slot) == r.checkpointed:
            out["checkpoint.logits"] = _host(self.checkpoint_logits[slot])
        return out, {"tokens": r.tokens, "checkpointed": r.checkpointed, "live": r.live, "page_size": self.page_size}

    def import_lane(self, slot: int, tensors: dict, meta: dict) -> None:
        """Make `slot` (free or retained) a retained lane holding an image from export_lane. ValueError when the
        image does not fit this cache's shapes; CapacityError when the lane is running or the pages cannot be had."""
        try:
            tokens, live, checkpointed = [int(t) for t in meta["tokens"]], bool(meta["live"]), int(meta["checkpointed"])
        except (KeyError, TypeError, ValueError):
            raise ValueError("the image's metadata lacks its tokens, checkpoint or live flag") from None
        n_pages = -(-len(tokens) // self.page_size)
        want = {}
        for i, (k, _) in self.kv.items():
            if i == "mtp" and "kv.mtp.k" not in tensors:   # an image saved without speculative decoding
                continue
            want[f"kv.{i}.k"] = want[f"kv.{i}.v"] = ((n_pages, *k.shape[1:]), k.dtype)
        for i, (conv, state) in self.gdn.items():
            parts = ("checkpoint.", "") if live else ("checkpoint.",)
            for p in parts:
                want[f"gdn.{i}.{p}conv"], want[f"gdn.{i}.{p}state"] = (conv.shape[1:], conv.dtype), (state.shape[1:], state.dtype)
        if "checkpoint.logits" in tensors:   # the prompt's last logits (images of lanes that kept them)
            want["checkpoint.logits"] = (self.checkpoint_logits.shape[1:], self.checkpoint_logits.dtype)
        if meta.get("page_size") != self.page_size or not 0 < checkpointed <= len(tokens):
            raise ValueError(f"the image's page size {meta.get('page_size')} or checkpoint does not fit this server "
                             f"(page size {self.page_size})")
        for name, (shape, dtype) in want.items():
            t = tensors.get(name)
            if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"the image's {name} is {None if t is None else (tuple(t.shape), t.dtype)}; this "
                                 f"model's cache needs {(tuple(shape), dtype)}")
        if slot in self.retained:
            self.release(slot, self.retained.pop(slot).pages)
        if slot not in self.free_slots:
            raise CapacityError(f"lane {slot} is running a request")
        if not self._reclaim(n_pages):
            raise CapacityError(f"the image needs {n_pages} KV pages; {len(self.free_pages)} are free")
        self.free_slots.remove(slot)
        pages = [self.free_pages.pop() for _ in range(n_pages)]
        idx = torch.tensor(pages, device=self.device)
        for i, (k, v) in self.kv.items():
            if f"kv.{i}.k" in want:   # (the MTP layer's KV, when the image lacks it, only shapes later drafts)
                k[idx], v[idx] = tensors[f"kv.{i}.k"].to(self.device), tensors[f"kv.{i}.v"].to(self.device)
        for i, (conv, state) in self.gdn.items():
            self.checkpoints[i][0][slot].copy_(tensors[f"gdn.{i}.checkpoint.conv"])
            self.checkpoints[i][1][slot].copy_(tensors[f"gdn.{i}.checkpoint.state"])
            if live:
                conv[slot].copy_(tensors[f"gdn.{i}.conv"])
                state[slot].copy_(tensors[f"gdn.{i}.state"])
        self.logits_after.pop(slot, None)
        if "checkpoint.logits" in tensors:
            self.checkpoint_logits[slot].copy_(tensors["checkpoint.logits"])
            self.logits_after[slot] = checkpointed
        self.retained[slot] = Retained(tokens, checkpointed, live, pages)

    def erase_lane(self, slot: int) -> int:
        """Give back a retained lane; returns the tokens it held (0: it held none)."""
        r = self.retained.pop(slot, None)
        if r is None:
            return 0
        self.release(slot, r.pages)
        return len(r.tokens)

    def _reclaim(self, need: int, snapshots: bool = True) -> bool:
        """Give back retained lanes, then (snapshots) prefix snapshots, oldest first, until `need` pages are free;
        False when they cannot be."""
        while need > len(self.free_pages) and (self.retained or (snapshots and self.snapshots)):
            self._evict() if self.retained else self._drop_snapshot()
        return need <= len(self.free_pages)

    def _evict(self) -> None:
        slot, r = next(iter(self.retained.items()))
        if self.cache_ram_bytes:
            self._to_host(slot)
        del self.retained[slot]
        self.release(slot, r.pages)

    # -- host RAM (--cache-ram) ----------------------------------------------------------------------------
    def _to_host(self, slot: int) -> None:
        """Keep an image of the retained lane in host memory, dropping the oldest images beyond the budget."""
        tensors, meta = self.export_lane(slot)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if nbytes > self.cache_ram_bytes:
            return
        self.host_lanes.append(HostLane(tensors, meta, nbytes))
        while self.host_bytes > self.cache_ram_bytes:
            self.host_lanes.pop(0)

    def _from_host(self, prompt: list[int]) -> None:
        """Bring back into a lane the host image that serves `prompt` furthest, when it serves it further than every
        retained lane; it stays in host memory when no lane or not enough pages can be had."""
        if not self.host_lanes:
            return
        on_gpu = (self._best_retained(prompt) or (0,))[0]
        n, i = max(((n, i) for i, h in enumerate(self.host_lanes) for n, live in h.held.anchors()
                    if _serves(prompt, h.held.tokens, n, live, "checkpoint.logits" in h.tensors)), default=(0, -1))
        if n <= on_gpu:
            return
        lane = self.host_lanes.pop(i)
        if not self.free_slots and self.retained:
            self._evict()   # the oldest retained lane's image goes to host memory in its place
        if self.free_slots:
            try:
                self.import_lane(self.free_slots[-1], lane.tensors, lane.meta)
                return
            except CapacityError:
                pass
        self.host_lanes.append(lane)

    @property
    def host_bytes(self) -> int:
        return sum(h.nbytes for h in self.host_lanes)

    @property
    def available_pages(self) -> int:
        """Pages free now or held by retained lanes and snapshots (given back on demand)."""
        return len(self.free_pages) + self.kept_pages

    @property
    def kept_pages(self) -> int:
        """Pages held by retained lanes and snapshots."""
        return sum(len(r.pages) for r in (*self.retained.values(), *self.snapshots.values()))

    @property
    def in_use(self) -> tuple[int, int]:
        """(busy lanes, used pages) of running sequences: both return to 0 when every sequence has ended (retained
        lanes and their pages and snapshot pages are not counted: they are given back on demand)."""
        return (self.max_seqs - len(self.free_slots) - len(self.retained),
                self.num_pages - len(self.free_pages) - self.kept_pages)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A copy in host memory (`.cpu()` of a CPU tensor would be the tensor itself, which the lane overwrites)."""
    return t.to("cpu", copy=True)


def _serves(prompt: list[int], tokens: list[int], n: int, live: bool, logits: bool) -> bool:
    """Whether a state after tokens[:n] (the lane's own when live) can start `prompt`: its first n tokens are those,
    and at least one token is left to run for the logits, or none where the checkpoint kept them (logits)."""
    reach = n < len(prompt) or (not live and logits and n == len(prompt))
    return 0 < n and reach and prompt[:n] == tokens[:n]


def _copy_states(dst: dict, di: int, src: dict, si: int) -> None:
    """dst[layer][k][di] <- src[layer][k][si] for both GDN state tensors (conv, recurrent) of every GDN layer."""
    for i, pair in src.items():
        for d, t in zip(dst[i], pair):
            d[di].copy_(t[si])


def plan_kv_pages(cfg: HybridConfig, device, kv_dtype, max_seqs: int, max_context: int, page_size: int,
                  prefill_chunk: int, kv_capacity: str | int = "auto", scratch_bytes: int = 0,
                  prefix_caching: bool = False, prefix_snapshots: int = 0, mtp: bool = False) -> int:
    """KV pages to allocate: every lane at full context when that fits; with `auto` on a GPU, what is left
    after the weights, the GDN states and a workspace reserve. Refuses a context that cannot fit once."""
    pages_per_seq = -(-max_context // page_size)
    want = max_seqs * pages_per_seq
    if kv_capacity != "auto":
        return max(int(kv_capacity), 1)
    if torch.device(device).type != "cuda":
        return want
    attn_layers = sum(cfg.is_attention(i) for i in range(cfg.layers))
    page_bytes = 2 * (attn_layers + mtp) * page_size * cfg.kv_heads * cfg.head_dim * kv_dtype.itemsize
    # lanes and scratch + checkpoints, snapshots
    gdn_slots = max_seqs + 1 + (max_seqs if prefix_caching else 0) + prefix_snapshots
    gdn_bytes = (cfg.layers - attn_layers) * gdn_slots * (
        cfg.v_heads * cfg.k_dim * cfg.v_dim * 4 + cfg.conv_channels * (cfg.conv_width - 1) * 2)
    free, _ = torch.cuda.mem_get_info(device)
    # activations of the largest prefill chunk (a few [chunk, widest projection] buffers, in bf16 elements; the
    # MoE forms' fp32 per-slot buffers h [chunk, K, I] and ys [chunk, K, H] count twice) plus headroom
    widest = max(cfg.intermediate * 2, cfg.conv_channels, 2 * cfg.experts_per_token * max(cfg.hidden, cfg.expert_intermediate),
                 cfg.vocab // 8)
    reserve = (1 << 30) + 8 * prefill_chunk * max(widest, cfg.hidden) * 2 + scratch_bytes
    fit = (free - gdn_bytes - reserve) // page_bytes
    if fit < pages_per_seq:
        raise CapacityError(f"--max-context {max_context} does not fit: after the weights, GDN states and a "
                            f"{reserve >> 20} MiB workspace, {max(fit, 0) * page_size} tokens of KV fit in GPU memory")
    return int(min(want, fit))
