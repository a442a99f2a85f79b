"""The engine on the generated kernels (bf16, CUDA-graph decode) against the fp32 transformers oracle
written by tests/gpu/make_oracle.py (NINFER_ORACLE_DIR): logits within model_bf16 at every position,
greedy tokens identical wherever the oracle's top-1 margin exceeds that tolerance, a batch of 8 equal
to each prompt alone, and the reference backend in agreement."""
import os
from pathlib import Path

import pytest
import torch

from ninfer.runtime.tolerance import compare

pytestmark = pytest.mark.gpu
ORACLE = Path(os.environ.get("NINFER_ORACLE_DIR", Path(__file__).resolve().parents[2] / ".carry" / "oracle"))
KINDS = ["dense", "moe", "next"]


def cases(kind):
    path = ORACLE / f"{kind}.oracle.pt"
    if not path.is_file():
        pytest.skip(f"no oracle at {path} (python tests/gpu/make_oracle.py {ORACLE})")
    return torch.load(path)


@pytest.fixture(scope="module")
def engines():
    from ninfer.runtime.engine import Engine
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = Engine(ORACLE / f"{kind}.ninfer", backend="cuda", max_context=128, max_seqs=8, prefill_chunk=16)
        return made[kind]
    return get


def margin_ok_prefix(logits: torch.Tensor, n_prompt: int, atol: float) -> int:
    """How many greedy tokens the oracle decides by more than twice the tolerance (top-1 minus top-2)."""
    top2 = logits[n_prompt - 1: -1].float().topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    for i, m in enumerate(margins):
        if m <= 2 * atol:
            return i
    return len(margins)


class Routing:
    """A backend proxy that records every moe_topk result (weights, ids), or replays a recording into them.

    Top-k routing is discontinuous: on random tiny MoE models about 2 % of (token, layer) choices sit within
    bf16 noise of a tie, and one flipped expert moves the logits far beyond any bf16 tolerance (transformers
    itself in bf16 is 0.15 / 0.08 rel_l2 from its fp32 run). So the logits test replays the fp32 reference
    engine's routing (the oracle's, up to 2e-4) in the cuda run, and measures the kernels' precision; the
    routing kernels are tested on their own (moe_router within model_fp32, moe_topk exact) and the
    unpinned agreement rate below."""

    def __init__(self, inner, replay=None):
        self.inner, self.replay, self.log = inner, replay, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, op, **args):
        self.inner.run(op, **args)
        if op != "moe_topk":
            return
        if self.replay is None:
            self.log.append((args["weights"].cpu().clone(), args["ids"].cpu().clone()))
        else:
            w, i = self.replay.pop(0)
            args["weights"].copy_(w)
            args["ids"].copy_(i)


def routed(eng, ids, replay=None):
    inner, eng.be = eng.be, Routing(eng.be, replay)
    try:
        return eng.score(ids), eng.be.log
    finally:
        eng.be = inner


@pytest.fixture(scope="module")
def reference_engines():
    from ninfer.runtime.engine import Engine
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = Engine(ORACLE / f"{kind}.ninfer", backend="reference", max_context=128, prefill_chunk=16)
        return made[kind]
    return get


@pytest.mark.parametrize("kind", KINDS)
def test_logits_within_bf16_tolerance(engines, reference_engines, kind):
    eng = engines(kind)
    preset = eng.be.manifest.tolerances["model_bf16"]
    for case in cases(kind)[:4]:
        ids = case["prompt"] + case["greedy"]
        if kind == "dense":
            got = eng.score(ids)
        else:   # MoE: the oracle's routing, see Routing
            _, log = routed(reference_engines(kind), ids)
            got, _ = routed(eng, ids, replay=log)
        v = compare(got.float(), case["logits"].float(), preset, f"{kind} n={len(case['prompt'])}")
        assert v, v.detail
    assert eng.cache.in_use == (0, 0)


@pytest.mark.parametrize("kind", ["moe", "next"])
def test_unpinned_routing_agrees_with_the_reference(engines, reference_engines, kind):
    """The cuda engine's own routing (fp32 router logits from bf16 activations) picks the reference's expert
    set for nearly every (token, layer): only near-ties may differ."""
    agree = total = 0
    for case in cases(kind)[:4]:
        ids = case["prompt"] + case["greedy"]
        _, want = routed(reference_engines(kind), ids)
        _, got = routed(engines(kind), ids)
        assert len(got) == len(want)
        for (_, a), (_, b) in zip(got, want):
            agree += (a.sort(-1).values == b.sort(-1).values).all(-1).sum().item()
            total += a.shape[0]
    assert agree / total >= 0.95, f"{kind}: routing agrees on {agree} of {total} (token, layer) choices"


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_where_the_oracle_is_decided(engines, kind):
    eng = engines(kind)
    atol = eng.be.manifest.tolerances["model_bf16"]["atol"]
    for case in cases(kind):
        n = len(case["prompt"])
        decided = margin_ok_prefix(case["logits"], n, atol)
        got = eng.generate([case["prompt"]], max_new=len(case["greedy"]))[0].generated
        assert got[:decided] == case["greedy"][:decided], f"{kind} n={n}: first {decided} tokens are decided"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_batch_of_8_equals_each_alone_on_gpu(engines, kind):
    """Batched and alone runs agree token for token up to the first near-tie. The decode kernels are not
    bitwise batch-invariant (a linear route at T = 8 accumulates in another order than at T = 1; logits move
    by ~1e-2), so a sequence may part from its alone run only where its own top-1 margin, scored alone, is
    within twice model_bf16's atol (the oracle tests' rule); a lane mix-up or a state leak between lanes
    moves logits far beyond that."""
    eng = engines(kind)
    atol = eng.be.manifest.tolerances["model_bf16"]["atol"]
    prompts = [c["prompt"] for c in cases(kind)]
    batched = [s.generated for s in eng.generate(prompts, max_new=16)]
    alone = [eng.generate([p], max_new=16)[0].generated for p in prompts]
    for i, (p, b, a) in enumerate(zip(prompts, batched, alone)):
        d = next((j for j, (x, y) in enumerate(zip(b, a)) if x != y), None)
        if d is None:
            continue
        top2 = eng.score(p + a[:d])[-1].float().topk(2).values
        margin = (top2[0] - top2[1]).item()
        assert margin <= 2 * atol, f"{kind} prompt {i}: batched parts from alone at token {d}, where the margin is {margin:.3f}"
    assert eng.cache.in_use == (0, 0)


def test_reference_backend_agrees(engines):
    from ninfer.runtime.engine import Engine
    eng = engines("dense")
    ref = Engine(ORACLE / "dense.ninfer", backend="reference", max_context=128)
    preset = eng.be.manifest.tolerances["model_bf16"]
    ids = cases("dense")[2]["prompt"]
    v = compare(eng.score(ids).float().cpu(), ref.score(ids), preset, "cuda vs reference")
    assert v, v.detail


PACKED = [("dense", "mix"), ("dense", "w8"), ("dense", "fp8"), ("moe", "mix"), ("next", "mix")]


@pytest.mark.parametrize("kind,fmt", PACKED)
def test_packed_weights_match_the_reference_backend(kind, fmt):
    """Linear and expert weights kept packed (q4/q5/q6/w8/fp8 kernels) against the reference backend on the
    same artifact (exact decode, fp32 math): logits within model_bf16 at every position (MoE kinds with the
    reference's routing replayed, as in the oracle test), greedy tokens identical wherever the reference's
    top-1 margin exceeds twice the tolerance."""
    from ninfer.runtime.engine import Engine
    from ninfer.runtime.weights import PackedWeight
    path = ORACLE / f"{kind}.{fmt}.ninfer"
    if not path.is_file():
        pytest.skip(f"no packed artifact at {path} (python tests/gpu/make_oracle.py {ORACLE})")
    eng = Engine(path, backend="cuda", max_context=128, max_seqs=8, prefill_chunk=16)
    ref = Engine(path, backend="reference", max_context=128, prefill_chunk=16)   # same chunks: routing replays 1:1
    assert any(isinstance(w, PackedWeight) for w in eng.weights.values())
    preset = eng.be.manifest.tolerances["model_bf16"]
    for case in cases(kind)[:3]:
        ids = case["prompt"] + case["greedy"]
        want, log = routed(ref, ids)
        got, _ = routed(eng, ids, replay=log if kind != "dense" else None)   # MoE: the reference's routing, see Routing
        v = compare(got.float().cpu(), want, preset, f"{kind}.{fmt} n={len(case['prompt'])}")
        assert v, v.detail
        n = len(case["prompt"])
        greedy = ref.generate([case["prompt"]], max_new=16)[0].generated
        decided = margin_ok_prefix(ref.score(case["prompt"] + greedy), n, preset["atol"])
        got = eng.generate([case["prompt"]], max_new=16)[0].generated
        assert got[:decided] == greedy[:decided], f"{kind}.{fmt} n={n}: first {decided} tokens are decided"
    assert eng.cache.in_use == (0, 0)


def test_penalties_see_the_same_counts_with_and_without_graphs():
    """The decode graph adds each sampled token to its sequence's counts inside the graph (count_tokens, captured:
    the next step's presence / frequency penalties read them); the eager path adds them with the same call outside
    any graph. Seeded sampling with penalties must give the same tokens both ways, in a batch with differently
    penalised sequences."""
    from ninfer.runtime.engine import Engine, SamplingParams
    path = ORACLE / "dense.ninfer"
    if not path.is_file():
        pytest.skip(f"no artifact at {path} (python tests/gpu/make_oracle.py {ORACLE})")
    params = [SamplingParams(temperature=0.8, top_k=0, top_p=1.0, presence_penalty=1.5, seed=11),
              SamplingParams(temperature=0.7, top_k=20, top_p=0.95, frequency_penalty=0.8, seed=12),
              SamplingParams(temperature=0.0, seed=13)]
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    runs = []
    for graphs in (True, False):
        eng = Engine(path, backend="cuda", max_context=128, max_seqs=4, prefill_chunk=16, cuda_graphs=graphs)
        try:
            runs.append([s.generated for s in eng.generate(prompts, max_new=24, sampling=params)])
        finally:
            eng.close()
    assert runs[0] == runs[1]
    assert len(set(runs[0][0])) > 1, "the sampled sequence should vary"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_decode_steps_ahead_give_the_same_tokens(monkeypatch, kind):
    """Engine._decode_graphs keeps the next step in flight on the real graphs (its rows fed on the device by the
    step before, the host buffers taken in turn): the same tokens as one synchronous step per call, for greedy and
    penalised seeded sampling in one batch, with every lane and page back in the pool. (Batch changes, finishing
    lanes and releases in flight: tests/unit/test_decode_ahead.py; here every lane runs to the same max_new, so
    both runs step the same batches and the kernels see the same T.)"""
    from ninfer.runtime import engine as engine_mod
    from ninfer.runtime.engine import Engine, SamplingParams
    path = ORACLE / f"{kind}.ninfer"
    if not path.is_file():
        pytest.skip(f"no artifact at {path} (python tests/gpu/make_oracle.py {ORACLE})")
    params = [SamplingParams(temperature=0.8, presence_penalty=1.5, seed=21), SamplingParams(),
              SamplingParams(temperature=0.7, top_k=20, top_p=0.95, frequency_penalty=0.8, seed=22)]
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    from ninfer.runtime import decode_graph
    launches, real = [], decode_graph._Graph.launch

    def launch(graph, seqs, ahead=False):
        launches.append(ahead)
        return real(graph, seqs, ahead)
    monkeypatch.setattr(decode_graph._Graph, "launch", launch)
    eng = Engine(path, backend="cuda", max_context=128, max_seqs=4, prefill_chunk=16)
    try:
        runs = []
        for on in (False, True):
            monkeypatch.setattr(engine_mod, "DECODE_AHEAD", on)
            launches.clear()
            runs.append([s.generated for s in eng.generate(prompts, max_new=24, sampling=params)])
            assert eng.cache.in_use == (0, 0)
            assert sum(launches) >= (20 if on else 0) and (on or not any(launches))   # fed on the device
        assert runs[0] == runs[1]
        assert len(set(runs[0][0])) > 1, "the sampled sequence should vary"
    finally:
        eng.close()


@pytest.mark.parametrize("artifact", ["moe.ninfer", "moe.mix.ninfer", "next.mix.ninfer"])
def test_the_shared_expert_stream_gives_the_same_model(monkeypatch, artifact):
    """The shared expert on a second stream (blocks.MOE_SHARED_STREAM: a fork and a join, captured into the decode
    graph as parallel branches) runs the same kernels on the same inputs: the same logits bit for bit, and the
    same greedy tokens through the decode graphs, with every lane and page back in the pool."""
    from ninfer.runtime.engine import Engine
    from ninfer.runtime.models import blocks
    path = ORACLE / artifact
    if not path.is_file():
        pytest.skip(f"no artifact at {path} (python tests/gpu/make_oracle.py {ORACLE})")
    prompts = [c["prompt"] for c in cases(artifact.split(".")[0])[:3]]
    runs = []
    for on in (False, True):
        monkeypatch.setattr(blocks, "MOE_SHARED_STREAM", on)
        eng = Engine(path, backend="cuda", max_context=128, max_seqs=4, prefill_chunk=16)
        try:
            runs.append((eng.score(prompts[0]), [s.generated for s in eng.generate(prompts, max_new=16)]))
            assert eng.cache.in_use == (0, 0)
        finally:
            eng.close()
    assert torch.equal(runs[0][0], runs[1][0]), "logits"
    assert runs[0][1] == runs[1][1], "greedy tokens"
    assert blocks._SIDE_STREAMS, "the side stream was used"


@pytest.mark.parametrize("kind", ["dense", "next"])
def test_fp8_kv_cache_matches_the_reference_backend(kind):
    """kv_cache_dtype fp8 (E4M3 codes) on the cuda engine against the reference backend with the same cache: the
    logits of a 72-token sequence in one prefill step (the prefill route) within model_bf16 (MoE routing pinned to
    the reference's), then 16 greedy tokens (the decode graphs and the split route), on the dense model each the
    reference's top-1 or within 2 x atol of it (the tiny random models' top logits are near-ties at most
    positions); lanes and pages back to the pool."""
    from ninfer.runtime.engine import Engine
    case = cases(kind)[2]
    ids = case["prompt"] + case["greedy"]
    got, want = (Engine(ORACLE / f"{kind}.ninfer", backend=b, max_context=128, max_seqs=2, prefill_chunk=128,
                        kv_cache_dtype="fp8") for b in ("cuda", "reference"))
    assert next(iter(got.cache.kv.values()))[0].dtype == torch.uint8 and got.graphs is not None
    preset = got.be.manifest.tolerances["model_bf16"]
    _, log = routed(want, ids)   # MoE (next): the reference's routing, see Routing
    v = compare(routed(got, ids, replay=log)[0].float().cpu(), routed(want, ids)[0], preset,
                f"{kind} fp8 KV: cuda vs reference")
    assert v, v.detail
    n = len(case["prompt"])
    toks = got.generate([case["prompt"]], max_new=16)[0].generated
    ref = want.score(case["prompt"] + toks)[n - 1:-1]   # the reference's logits for each generated position
    gap = ref.max(-1).values - ref[torch.arange(len(toks)), torch.tensor(toks)]
    assert len(toks) == 16
    if kind == "dense":   # (unpinned MoE routing flips on near-ties and moves the logits far: next's tokens can't be held)
        assert (gap <= 2 * preset["atol"]).all(), f"{kind}: top-1 gaps {gap.tolist()}"
    assert got.cache.in_use == (0, 0) and want.cache.in_use == (0, 0)


@pytest.mark.parametrize("kind", ["dense", "next"])
def test_prefix_caching_gives_the_same_model(kind):
    """A next prompt that takes over a finished request's lane (its KV pages; its GDN state restored from the
    prompt's checkpoint on the device, or the lane's own state after the tokens it fed; the graphs then read that
    lane), or that starts a lane from a prefix snapshot (KV pages and GDN state copied on the device), or repeats a
    prompt whose checkpoint kept its last token's logits (nothing run before the first token). From the
    checkpoint or the snapshot, both engines run the same chunks, so the tokens must be equal; from the lane's own
    state, its generated tokens were run by decode steps, not by a prefill chunk, so the next logits are compared
    within model_bf16."""
    from ninfer.runtime.engine import Engine, SamplingParams
    from ninfer.runtime.tolerance import compare
    path = ORACLE / f"{kind}.ninfer"
    if not path.is_file():
        pytest.skip(f"no artifact at {path} (python tests/gpu/make_oracle.py {ORACLE})")
    first = [(5 * i + 7) % 90 + 3 for i in range(32)]   # two whole chunks of 16
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, presence_penalty=1.2, seed=31)]
    runs, logits = [], []
    for cached in (True, False):
        eng = Engine(path, backend="cuda", max_context=128, max_seqs=2, prefill_chunk=16, prefix_caching=cached,
                     prefix_snapshots=1 if cached else 0)
        try:
            preset = eng.be.manifest.tolerances["model_bf16"]
            answer = eng.generate([first], max_new=6)[0].generated
            tool_loop = first + answer + [45, 46, 47]                       # the whole generation: the lane's state
            seq = eng.open(tool_loop, max_new=1)
            assert seq.cached in ((len(first) + len(answer) - 1, len(first) + len(answer)) if cached else (0,))
            logits.append(eng._step([seq], [(seq.prefilled, len(tool_loop))]).float().cpu())
            eng.release(seq)   # its prompt never finished: the lane keeps what its checkpoint covers, `first`
            turn = first + [answer[0] + 1, 60, 61] + [40, 41, 42, 43, 44]   # a re-rendered answer: the checkpoint
            seqs = eng.generate([turn, turn], max_new=16, sampling=params)
            assert [s.cached for s in seqs] == ([len(first), 0] if cached else [0, 0])
            other = eng.open(first + [50, 51], max_new=1, snapshot_at=len(first))   # its first turn: `first`
            while not eng.prefill(other):
                pass
            eng.release(other, retain=False)
            fresh = eng.generate([first + [52, 53, 54]], max_new=16)[0]               # a new conversation
            assert fresh.cached == (len(first) if cached else 0)
            same = eng.generate([first + [52, 53, 54]], max_new=16)[0]   # a retry: its last token's logits kept
            assert same.cached == (len(first) + 3 if cached else 0) and same.generated == fresh.generated
            runs.append([s.generated for s in seqs] + [fresh.generated])
            assert eng.cache.in_use == (0, 0)
        finally:
            eng.close()
    assert runs[0] == runs[1]
    verdict = compare(logits[0], logits[1], preset, "next logits")
    assert verdict, verdict.detail


@pytest.mark.parametrize("kind", ["dense", "next"])
def test_lanes_in_host_memory_give_the_same_model(kind):
    """--cache-ram on the GPU: one lane; each new conversation gives the last one's lane back, its image copied to host
    memory; the first conversation's next turn copies it back (KV pages and GDN states, device <- host). Both engines
    then run the same chunks after the first prompt, so the tokens must be equal to an engine without it."""
    from ninfer.runtime.engine import Engine
    path = ORACLE / f"{kind}.ninfer"
    if not path.is_file():
        pytest.skip(f"no artifact at {path} (python tests/gpu/make_oracle.py {ORACLE})")
    first = [(5 * i + 7) % 90 + 3 for i in range(32)]
    other = [(3 * i + 5) % 90 + 3 for i in range(32)]
    runs = []
    for cached in (True, False):
        eng = Engine(path, backend="cuda", max_context=128, max_seqs=1, prefill_chunk=16, prefix_caching=cached,
                     cache_ram_bytes=256 << 20)
        try:
            a = eng.generate([first], max_new=4)[0]
            eng.generate([other], max_new=4)
            assert len(eng.cache.host_lanes) == (1 if cached else 0)
            turn = eng.generate([first + [a.generated[0] + 1, 60, 61, 40, 41]], max_new=16)[0]
            assert turn.cached == (len(first) if cached else 0)
            runs.append(turn.generated)
            assert eng.cache.in_use == (0, 0)
        finally:
            eng.close()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_eager_profile_times_every_launch(engines, kind):
    """ninfer-bench model --profile: one eager decode step under CUPTI gives every kernel the backend launched a GPU
    time of its own, and those times add up to less than the step took on the host clock (CUDA events around each
    launch counted the host's launch time: session 39's profile showed 10 us for a 2 us norm)."""
    import time

    from ninfer.cli.bench import _eager_profile
    eng = engines(kind)
    seq = eng.open(list(range(5, 25)), max_new=4)
    graphs, eng.graphs = eng.graphs, None
    try:
        while not eng.prefill(seq):
            pass
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        launches, us = _eager_profile(torch, eng.be, lambda: eng.decode([seq]))
        wall_us = 1e6 * (time.perf_counter() - t0)
    finally:
        eng.graphs = graphs
        eng.release(seq)
    symbols = {symbol for *_, symbol in launches}
    assert len(launches) > 20 and eng.be.profile is None
    assert all(us.get(s, 0.0) > 0.0 for s in symbols), sorted(s for s in symbols if not us.get(s))
    assert 0.0 < sum(us[s] for s in symbols) < wall_us
