"""The scheduler: one worker thread owns the engine; the asyncio loop only submits, cancels and reads events.

Admission is a bounded FIFO. A request that can never fit (its prompt plus one token exceeds the context,
or the KV pool) is refused before it is queued; a full queue and a request that waited too long are typed
overload errors. The worker admits requests in order while a lane is free and the KV pool can hold each
admitted request's reservation (prompt + output limit), so a running request never runs out of pages.

Continuous batching: every iteration runs one decode step for every decoding request (new requests join
the batch as soon as their prefill is done) and then one prefill chunk of the oldest prefilling request,
so a long prompt is interleaved with decode steps and running streams keep producing tokens. The chunk is
the engine's prefill_chunk while no request decodes (the fewest steps: each step reads every weight), and
at most prefill_chunk_decoding tokens while some do (their next token waits for the chunk).

Each request gets events back on its own asyncio queue: `Text` (new stable text and the token count),
then exactly one `Done` (finish reason, usage and timings) or `Failed`. Cancelling (client disconnect,
explicit cancel) frees the lane and the KV pages before the next engine step.

Stop strings are matched on the detokenised text here, so a stopped request frees its lane at once;
text that could still become a stop string is held back until it is decided.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .cache import CapacityError
from .engine import GREEDY, EngineError, SamplingParams, Sequence
from .tokenizer import StopStrings

log = logging.getLogger("ninfer.scheduler")


# -- errors a submit can raise or a request can end with ---------------------------------------------
class SchedulerError(Exception):
    """Base: `kind` names the typed error the server maps to its protocol's envelope."""
    kind = "internal_error"


class ContextTooLong(SchedulerError):
    kind = "context_length_exceeded"


class InvalidPrompt(SchedulerError):
    kind = "invalid_request"


class QueueFull(SchedulerError):
    kind = "queue_full"


class QueueTimeout(SchedulerError):
    kind = "queue_timeout"


class ShuttingDown(SchedulerError):
    kind = "shutting_down"


class EngineFailure(SchedulerError):
    kind = "internal_error"


# -- events -------------------------------------------------------------------------------------------
@dataclass
class Text:
    text: str          # newly stable text (may be empty while text is held back)
    tokens: int        # tokens this event accounts for


@dataclass
class Done:
    finish_reason: str             # "stop" | "length"
    stop_string: str | None        # the stop string that ended it, if one did
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_s: float
    prefill_s: float
    decode_s: float
    ttft_s: float                  # submit -> first token
    total_s: float


@dataclass
class Failed:
    error: SchedulerError


@dataclass
class Request:
    prompt: list[int]
    max_new: int
    sampling: SamplingParams = GREEDY
    stop_ids: frozenset = frozenset()
    stop_strings: tuple[str, ...] = ()
    detokenizer: object | None = None       # .push(token_id) -> str, .finish() -> str (tokenizer.StreamDecoder)
    snapshot_at: int = 0                    # keep a prefix snapshot of the prompt's first this many tokens
    info: dict = field(default_factory=dict)  # shown in /slots (request id, protocol, ...)


class Handle:
    """The loop side of one request: iterate its events; cancel() frees its lane."""

    _ids = itertools.count(1)

    def __init__(self, sched: "Scheduler", req: Request, loop: asyncio.AbstractEventLoop):
        self.id = next(self._ids)
        self.req = req
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.submitted = time.monotonic()
        self.deadline = self.submitted + sched.pending_timeout_s if sched.pending_timeout_s > 0 else None
        self.cancelled = False
        self.finished = False
        self._sched = sched
        # worker-side state
        self.seq: Sequence | None = None
        self.reserve_pages = 0
        self.admitted_at = 0.0
        self.first_token_at = 0.0
        self.stop = StopStrings(req.stop_strings)
        self.stop_hit: str | None = None
        self.emitted = 0   # generated tokens turned into events (a speculative round gives several at once)

    def cancel(self) -> None:
        """Idempotent; safe from the loop at any time (before, during or after generation)."""
        if not self.cancelled and not self.finished:
            self.cancelled = True
            self._sched._cancel(self)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished and self.events.empty():
            raise StopAsyncIteration
        ev = await self.events.get()
        if isinstance(ev, (Done, Failed)):
            self.finished = True
        return ev


class Scheduler:
    def __init__(self, engine, *, max_pending: int = 64, pending_timeout_ms: int = 300_000,
                 max_context: int | None = None, prefill_chunk_decoding: int | None = None):
        if prefill_chunk_decoding is not None and prefill_chunk_decoding < 1:
            raise ValueError(f"prefill_chunk_decoding must be >= 1 (or None: the engine's prefill_chunk), "
                             f"got {prefill_chunk_decoding}")
        self.engine = engine
        self.prefill_chunk_decoding = prefill_chunk_decoding
        cache = engine.cache
        # copied once so that the loop thread can check requests without touching the engine
        self.max_seqs = cache.max_seqs
        self.max_context = min(max_context or cache.max_context, cache.max_context)
        self.page_size = cache.page_size
        self.num_pages = cache.num_pages
        self.domain = engine.domain
        self.max_pending = max_pending
        self.pending_timeout_s = pending_timeout_ms / 1000.0
        self._cv = threading.Condition()
        self._pending: deque[Handle] = deque()
        self._cancels: list[Handle] = []
        self._calls: list = []   # (fn, future, loop): engine work the loop hands to the worker (slot save / restore)
        self._prefilling: list[Handle] = []
        self._decoding: list[Handle] = []
        self._stopping = False
        # counters (written by the worker, read by metrics)
        self.stats = dict(prefill_chunks=0, decode_steps=0, prompt_tokens=0, prompt_seconds=0.0,
                          predicted_tokens=0, predicted_seconds=0.0, cancelled=0, queue_full=0, queue_timeout=0,
                          too_long=0, failed=0, completed=0, prefix_cache_queries=0, prefix_cache_hits=0)
        self._snapshot = self._make_snapshot()
        self._thread = threading.Thread(target=self._run, name="ninfer-scheduler", daemon=True)
        self._thread.start()

    # -- loop side ------------------------------------------------------------------------------
    def check(self, prompt_len: int, max_new: int) -> int:
        """Refuse what can never fit; return the effective output limit (clamped to the context and pool)."""
        need = prompt_len + (1 if max_new > 0 else 0)
        if prompt_len < 1:
            raise InvalidPrompt("empty prompt: at least one token is needed")
        if need > self.max_context:
            raise ContextTooLong(f"the prompt has {prompt_len} tokens and at least {need} tokens of context are "
                                 f"needed; the maximum context is {self.max_context} tokens")
        if -(-need // self.page_size) > self.num_pages:
            raise ContextTooLong(f"the prompt needs {-(-need // self.page_size)} KV pages; the pool has "
                                 f"{self.num_pages}")
        room = min(self.max_context, self.num_pages * self.page_size) - prompt_len
        return max(0, min(max_new, room))

    def submit(self, req: Request) -> Handle:
        """Queue a request (from the event loop). Raises ContextTooLong, InvalidPrompt, QueueFull, ShuttingDown."""
        try:
            req.max_new = self.check(len(req.prompt), req.max_new)
        except ContextTooLong:
            self.stats["too_long"] += 1
            raise
        try:
            req.sampling.check()
        except EngineError as e:
            raise InvalidPrompt(str(e)) from None
        bad = next((t for t in req.prompt if not isinstance(t, int) or not 0 <= t < self.domain), None)
        if bad is not None:
            raise InvalidPrompt(f"token id {bad} is outside the vocabulary (valid ids: 0..{self.domain - 1})")
        handle = Handle(self, req, asyncio.get_running_loop())
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            free_lanes = max(0, self.max_seqs - len(self._prefilling) - len(self._decoding))
            if len(self._pending) >= self.max_pending + free_lanes:  # waiting beyond what free lanes take now
                self.stats["queue_full"] += 1
                raise QueueFull(f"{len(self._pending)} requests are already waiting (--max-pending-requests "
                                f"{self.max_pending}); retry later")
            self._pending.append(handle)
            self._cv.notify()
        return handle

    def call(self, fn) -> asyncio.Future:
        """Run fn() on the worker thread between steps (the engine is the worker's alone); await its result (or its
        exception)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            self._calls.append((fn, fut, loop))
            self._cv.notify()
        return fut

    def _cancel(self, handle: Handle) -> None:
        with self._cv:
            self._cancels.append(handle)
            self._cv.notify()

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def active(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    def snapshot(self) -> dict:
        """What each lane holds and the pool usage, as of the end of the last worker iteration."""
        return self._snapshot

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    # -- worker side ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            out: list[tuple[Handle, object]] = []
            try:
                if not self._iteration(out):
                    self._deliver(out)
                    return
            except Exception as e:  # never let the worker die: fail what was running, keep serving
                log.exception("scheduler iteration failed")
                for h in self._prefilling + self._decoding:
                    self._fail(h, EngineFailure(f"internal error: {type(e).__name__}: {e}"), out)
            self._snapshot = self._make_snapshot()
            self._deliver(out)

    def _iteration(self, out) -> bool:
        with self._cv:
            while not (self._pending or self._prefilling or self._decoding or self._cancels or self._calls
                       or self._stopping):
                self._cv.wait()
            cancels, self._cancels = self._cancels, []
            calls, self._calls = self._calls, []
            if self._stopping:
                err = ShuttingDown("the server is shutting down")
                for h in list(self._pending):
                    out.append((h, Failed(err)))
                self._pending.clear()
                stopping = True
            else:
                stopping = False
                now = time.monotonic()
                for h in [h for h in self._pending if h.deadline is not None and now > h.deadline]:
                    self._pending.remove(h)
                    self.stats["queue_timeout"] += 1
                    out.append((h, Failed(QueueTimeout(
                        f"the request waited {now - h.submitted:.1f} s for a lane (--pending-timeout-ms "
                        f"{int(self.pending_timeout_s * 1000)}); the server is busy, retry later"))))
                admit = []
                while self._pending and self._can_admit(self._pending[0], admit):
                    admit.append(self._pending.popleft())
                for h in cancels:  # cancelled while still queued: just drop it
                    if h in self._pending:
                        self._pending.remove(h)
                        self.stats["cancelled"] += 1
        for h in cancels:
            if h in self._prefilling or h in self._decoding:
                self._release(h)
                self.stats["cancelled"] += 1
        settled = []
        for fn, fut, loop in calls:
            result, error = None, ShuttingDown("the server is shutting down")
            if not stopping:
                try:
                    result, error = fn(), None
                except Exception as e:  # the caller's to report
                    error = e
            settled.append((loop, fut, result, error))
        if settled:   # /slots shows what the calls did by the time their callers hear back
            self._snapshot = self._make_snapshot()
        for loop, fut, result, error in settled:
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # the loop is closed
                pass
        if stopping:
            for h in self._prefilling + self._decoding:
                self._fail(h, ShuttingDown("the server is shutting down"), out)
            return False
        for h in admit:
            if h.cancelled:
                self.stats["cancelled"] += 1
                continue
            self._open(h, out)
        self._step(out)
        return True

    def _can_admit(self, h: Handle, admitting: list[Handle]) -> bool:
        running = self._prefilling + self._decoding + admitting
        if len(running) >= self.max_seqs:
            return False
        return sum(r.reserve_pages for r in running) + self._reservation(h) <= self.num_pages

    def _reservation(self, h: Handle) -> int:
        tokens = min(len(h.req.prompt) + h.req.max_new, self.max_context)
        return -(-tokens // self.page_size)

    def _open(self, h: Handle, out) -> None:
        try:
            h.seq = self.engine.open(h.req.prompt, max_new=h.req.max_new, stop_ids=h.req.stop_ids,
                                     sampling=h.req.sampling, snapshot_at=h.req.snapshot_at)
        except CapacityError as e:
            self._fail(h, ContextTooLong(str(e)), out)
            return
        except EngineError as e:
            self._fail(h, InvalidPrompt(str(e)), out)
            return
        except Exception as e:  # this request only: the others keep running
            log.exception("engine.open failed")
            self._fail(h, EngineFailure(f"internal error: {type(e).__name__}: {e}"), out)
            return
        h.reserve_pages = self._reservation(h)
        h.admitted_at = time.monotonic()
        self.stats["prefix_cache_queries"] += len(h.seq.prompt)   # in tokens, as vLLM counts them
        self.stats["prefix_cache_hits"] += h.seq.cached
        self._prefilling.append(h)

    def _step(self, out) -> None:
        live = [h for h in self._decoding if not h.cancelled]
        if live:
            t0 = time.perf_counter()
            before = sum(h.seq.n_generated for h in live)
            try:
                self.engine.decode([h.seq for h in live])
            except Exception as e:
                log.exception("decode step failed")
                for h in live:
                    self._fail(h, EngineFailure(f"decode failed: {type(e).__name__}: {e}"), out)
            else:
                self.stats["decode_steps"] += 1
                self.stats["predicted_tokens"] += sum(h.seq.n_generated for h in live) - before
                self.stats["predicted_seconds"] += time.perf_counter() - t0
                for h in live:
                    self._after_token(h, out)
        if self._prefilling:
            h = self._prefilling[0]
            seq = h.seq
            before = seq.prefilled
            t0 = time.perf_counter()
            try:
                done = self.engine.prefill(seq, self.prefill_chunk_decoding if self._decoding else None)
            except Exception as e:
                log.exception("prefill chunk failed")
                self._fail(h, EngineFailure(f"prefill failed: {type(e).__name__}: {e}"), out)
                return
            self.stats["prefill_chunks"] += seq.prefilled > before   # none ran for a prompt cached whole
            self.stats["prompt_tokens"] += seq.prefilled - before
            self.stats["prompt_seconds"] += time.perf_counter() - t0
            if done:
                self._prefilling.remove(h)
                self.stats["predicted_tokens"] += seq.n_generated
                if seq.n_generated:
                    self._decoding.append(h)
                    self._after_token(h, out)
                else:
                    self._finish(h, out)

    def _after_token(self, h: Handle, out) -> None:
        """The event of the tokens generated since the last one (one, or several after a speculative round); a stop
        string ends the request at the token that completes it (tokens after it are not reported)."""
        seq = h.seq
        if not h.first_token_at:
            h.first_token_at = time.monotonic()
        new = seq.tokens[len(seq.prompt) + h.emitted:]   # the newest generated tokens (no copy of them all)
        emit, start = "", h.emitted
        for i, tok in enumerate(new):
            h.emitted += 1
            last = i == len(new) - 1
            ended = last and seq.finish_reason is not None
            text = ""
            if h.req.detokenizer is not None and not (ended and seq.finish_reason == "stop" and tok in seq.stop_ids):
                text = h.req.detokenizer.push(tok)
            if ended and h.req.detokenizer is not None:
                text += h.req.detokenizer.finish()
            part, hit = h.stop.feed(text)
            emit += part
            if hit:
                h.stop_hit = h.stop.hit
                seq.finish_reason = "stop"
                break
            if ended:
                emit += h.stop.finish()
        out.append((h, Text(emit, h.emitted - start)))
        if seq.finish_reason is not None:
            self._finish(h, out)

    def _finish(self, h: Handle, out) -> None:
        seq = h.seq
        now = time.monotonic()
        done = Done(finish_reason=seq.finish_reason or "stop", stop_string=h.stop_hit,
                    prompt_tokens=len(seq.prompt), completion_tokens=h.emitted, cached_tokens=seq.cached,
                    queue_s=h.admitted_at - h.submitted, prefill_s=seq.prefill_s, decode_s=seq.decode_s,
                    ttft_s=(h.first_token_at - h.submitted) if h.first_token_at else 0.0,
                    total_s=now - h.submitted)
        self._release(h)
        self.stats["completed"] += 1
        out.append((h, done))

    def _fail(self, h: Handle, err: SchedulerError, out) -> None:
        self._release(h, retain=False)
        self.stats["failed"] += 1
        out.append((h, Failed(err)))

    def _release(self, h: Handle, retain: bool = True) -> None:
        if h in self._prefilling:
            self._prefilling.remove(h)
        if h in self._decoding:
            self._decoding.remove(h)
        if h.seq is not None:
            self.engine.release(h.seq, retain)
        h.reserve_pages = 0

    def _deliver(self, out) -> None:
        by_loop: dict = {}
        for h, ev in out:
            if not h.cancelled:
                by_loop.setdefault(h.loop, []).append((h, ev))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _make_snapshot(self) -> dict:
        busy, pages = self.engine.cache.in_use
        lanes = []
        for h in self._prefilling + self._decoding:
            seq = h.seq
            if seq is None or seq.slot is None:
                continue
            lanes.append(dict(slot=seq.slot, state="prefill" if h in self._prefilling else "decode",
                              n_prompt_tokens=len(seq.prompt), n_prefilled=seq.prefilled,
                              n_decoded=seq.n_generated, max_new=seq.max_new, kv_pages=len(seq.pages),
                              n_cached_tokens=seq.cached, **h.req.info))
        cache = self.engine.cache
        retained = [dict(slot=slot, state="retained", n_prompt_tokens=len(r.tokens), n_prefilled=len(r.tokens),
                         n_decoded=0, max_new=0, kv_pages=len(r.pages), n_cached_tokens=len(r.tokens))
                    for slot, r in cache.retained.items()]
        return dict(lanes_busy=busy, kv_pages_used=pages, kv_pages_total=self.num_pages, max_seqs=self.max_seqs,
                    pending=len(self._pending), lanes=lanes + retained, lanes_retained=len(retained),
                    kv_pages_retained=cache.kept_pages, prefix_snapshots=len(cache.snapshots),
                    cache_ram_lanes=len(cache.host_lanes), cache_ram_bytes=cache.host_bytes)


def _settle(fut: asyncio.Future, result, error) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(result)


def _put_all(items) -> None:
    for h, ev in items:
        h.events.put_nowait(ev)


__all__ = ["Scheduler", "Request", "Handle", "Text", "Done", "Failed", "SchedulerError",
           "ContextTooLong", "InvalidPrompt", "QueueFull", "QueueTimeout", "ShuttingDown", "EngineFailure"]
