"""Sequence state memory, planned once at start-up: a paged KV pool per attention layer (pages shared
by all sequences through per-sequence page lists) and a GDN conv/recurrent state slot per sequence.

A request that could never fit is refused before it starts; pages and slots go back to the pool when
a sequence ends, whatever ended it.

Prefix caching (optional): the GDN state cannot be rewound, so each lane keeps a checkpoint of its state at
the end of its prompt. A finished sequence's lane stays retained with its KV pages and two states: the
checkpoint (its prompt) and the lane's own (its prompt and the tokens it generated and fed). A later prompt
that extends either takes the lane over and prefills only the rest: a chat's next turn extends the prompt (the
template renders turn n + 1 as turn n's prompt plus the answer, its reasoning dropped, and the new message); a
tool loop's next call can extend the whole generation (reasoning of the current turn is kept). Retained lanes
and pages are given back, oldest first, whenever a lane or pages are wanted.
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


class SequenceCache:
    def __init__(self, cfg: HybridConfig, *, max_seqs: int, max_context: int, page_size: int, device,
                 dtype: torch.dtype, num_pages: int | None = None, kv_dtype: torch.dtype | None = None,
                 prefix_caching: bool = False):
        self.cfg, self.page_size, self.max_context, self.max_seqs = cfg, page_size, max_context, max_seqs
        self.pages_per_seq = -(-max_context // page_size)
        self.num_pages = num_pages or max_seqs * self.pages_per_seq
        shape = (self.num_pages, page_size, cfg.kv_heads, cfg.head_dim)
        kv_dtype = kv_dtype or dtype   # uint8: E4M3 codes (code 0 is 0.0)
        self.kv = {i: (torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
                   for i in range(cfg.layers) if cfg.is_attention(i)}
        # slot max_seqs is scratch for padding rows; real sequences use 0..max_seqs-1
        self.gdn = {i: (torch.zeros(max_seqs + 1, cfg.conv_channels, cfg.conv_width - 1, dtype=dtype, device=device),
                        torch.zeros(max_seqs + 1, cfg.v_heads, cfg.k_dim, cfg.v_dim, dtype=torch.float32, device=device))
                    for i in range(cfg.layers) if not cfg.is_attention(i)}
        # prefix caching: each lane's state at the end of its prompt, and the retained lanes (oldest first)
        self.prefix_caching = prefix_caching
        self.checkpoints = {i: (conv[:max_seqs].clone(), state[:max_seqs].clone())
                            for i, (conv, state) in self.gdn.items()} if prefix_caching else {}
        self.retained: dict[int, Retained] = {}
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        self.free_slots = list(range(max_seqs - 1, -1, -1))

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for pair in (*self.kv.values(), *self.gdn.values(), *self.checkpoints.values()) for t in pair)

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
        while need > len(self.free_pages) and self.retained:
            self._evict()
        if need > len(self.free_pages):
            raise CapacityError(f"out of KV pages: need {need} more, {len(self.free_pages)} free")
        for _ in range(max(need, 0)):
            pages.append(self.free_pages.pop())

    def release(self, slot: int | None, pages: list[int]) -> None:
        if slot is not None:
            self.free_slots.append(slot)
        self.free_pages.extend(reversed(pages))
        pages.clear()

    # -- prefix caching --------------------------------------------------------------------------------
    def checkpoint(self, slot: int) -> None:
        """Keep the slot's state (the end of its prompt) for prefix caching."""
        for i, (conv, state) in self.gdn.items():
            self.checkpoints[i][0][slot].copy_(conv[slot])
            self.checkpoints[i][1][slot].copy_(state[slot])

    def retain(self, slot: int, tokens: list[int], checkpointed: int, live: bool, pages: list[int]) -> None:
        """Keep a finished sequence's lane: the KV pages of `tokens` (the rest go back to the pool), its checkpoint
        of tokens[:checkpointed], and (live) its own state after all of `tokens`."""
        keep = -(-len(tokens) // self.page_size)
        self.free_pages.extend(reversed(pages[keep:]))
        self.retained[slot] = Retained(list(tokens), checkpointed, live, pages[:keep])
        pages.clear()

    def take_prefix(self, prompt: list[int]) -> tuple[int, list[int], int, int] | None:
        """The retained state covering the most tokens that `prompt` extends (by at least one token, whose logits
        the caller needs): (slot, the KV pages, the tokens they hold, the tokens the slot's checkpoint covers), the
        slot's state restored from its checkpoint where that is the state taken; None when there is none."""
        best = max(((n, live, s) for s, r in self.retained.items() for n, live in r.anchors()
                    if 0 < n < len(prompt) and prompt[:n] == r.tokens[:n]), default=None)
        if best is None:
            return None
        n, live, slot = best
        r = self.retained.pop(slot)
        keep = -(-n // self.page_size)
        self.free_pages.extend(reversed(r.pages[keep:]))
        if not live:
            for i, (conv, state) in self.gdn.items():
                conv[slot].copy_(self.checkpoints[i][0][slot])
                state[slot].copy_(self.checkpoints[i][1][slot])
        return slot, r.pages[:keep], n, r.checkpointed

    def _evict(self) -> None:
        slot, r = next(iter(self.retained.items()))
        del self.retained[slot]
        self.release(slot, r.pages)

    @property
    def available_pages(self) -> int:
        """Pages free now or held by retained lanes (given back on demand)."""
        return len(self.free_pages) + sum(len(r.pages) for r in self.retained.values())

    @property
    def in_use(self) -> tuple[int, int]:
        """(busy lanes, used pages) of running sequences: both return to 0 when every sequence has ended (retained
        lanes and their pages are not counted: they are given back on demand)."""
        kept = sum(len(r.pages) for r in self.retained.values())
        return (self.max_seqs - len(self.free_slots) - len(self.retained),
                self.num_pages - len(self.free_pages) - kept)


def plan_kv_pages(cfg: HybridConfig, device, kv_dtype, max_seqs: int, max_context: int, page_size: int,
                  prefill_chunk: int, kv_capacity: str | int = "auto", scratch_bytes: int = 0,
                  prefix_caching: bool = False) -> int:
    """KV pages to allocate: every lane at full context when that fits; with `auto` on a GPU, what is left
    after the weights, the GDN states and a workspace reserve. Refuses a context that cannot fit once."""
    pages_per_seq = -(-max_context // page_size)
    want = max_seqs * pages_per_seq
    if kv_capacity != "auto":
        return max(int(kv_capacity), 1)
    if torch.device(device).type != "cuda":
        return want
    attn_layers = sum(cfg.is_attention(i) for i in range(cfg.layers))
    page_bytes = 2 * attn_layers * page_size * cfg.kv_heads * cfg.head_dim * kv_dtype.itemsize
    gdn_slots = max_seqs + 1 + (max_seqs if prefix_caching else 0)   # + the prefix-caching checkpoints
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
