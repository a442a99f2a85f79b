"""Speculative decoding (MTP) on the generated kernels, bf16, against plain decoding on the same kernels.

A verify step runs K + 1 tokens a lane through the prefill-shaped routes (GDN conv + delta rule, multi-token GEMV
spans) where plain decoding runs gdn_decode and T = lanes; neither is bitwise equal to the other, so greedy outputs
agree token for token up to the first near-tie (a parting is allowed only where the fp32 reference model's logits of
the two tokens are within twice model_bf16's atol). Drafts come from the MTP layer (random: mostly
rejected), from prompt lookup (n-grams), and from the plain run's own tokens (accepted: the rollback of the rejected
tail and the commit of whole rounds); the verify step's CUDA graph against its launches; the MTP layer's output agrees with the reference backend's
within model_bf16."""
import os
from pathlib import Path

import pytest
import torch

from ninfer.runtime.tolerance import compare

pytestmark = pytest.mark.gpu
ORACLE = Path(os.environ.get("NINFER_ORACLE_DIR", Path(__file__).resolve().parents[2] / ".carry" / "oracle"))
KINDS = ["dense", "moe"]   # the tiny checkpoints that carry an MTP layer


def artifact(kind):
    path = ORACLE / f"{kind}.ninfer"
    if not path.is_file():
        pytest.skip(f"no artifact at {path} (python tests/gpu/make_oracle.py {ORACLE})")
    return path


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (7, 19, 33, 4)]


def wrong(at):
    """A change of the draft at index `at` (when a round drafts that many), or None."""
    def alter(drafts):
        if at < len(drafts):
            drafts[at] = (drafts[at] + 1) % 1024
    return None if at is None else alter


@pytest.fixture(scope="module")
def engines():
    from ninfer.runtime.engine import Engine
    from ninfer.runtime.speculative import SpeculativeConfig
    made = {}

    def get(kind, k=None, backend="cuda", cuda_graphs=True):
        """k: MTP with k drafts, or a SpeculativeConfig; None: plain decoding."""
        spec = SpeculativeConfig("mtp", k) if isinstance(k, int) else k
        key = (kind, spec, backend, cuda_graphs)
        if key not in made:
            made[key] = Engine(artifact(kind), backend=backend, max_context=400, max_seqs=4, prefill_chunk=16,
                               speculative=spec, cuda_graphs=cuda_graphs)
        return made[key]
    return get


def agree_up_to_near_ties(plain_eng, ps, got, want):
    """Each output equals plain decoding's, or parts from it where the exact model (the fp32 reference backend on
    the same artifact) cannot tell the two tokens apart: their fp32 logits within twice model_bf16's atol. (The
    bf16 plain run is no oracle: on the tiny moe model, H100, a router near-tie put its logits 0.37 off the fp32
    ones, and the rounds' token was the fp32 model's choice, 0.095 above plain's.)"""
    from ninfer.runtime.engine import Engine
    atol = plain_eng.be.manifest.tolerances["model_bf16"]["atol"]
    ref = None
    for i, (p, g, w) in enumerate(zip(ps, got, want)):
        d = next((j for j, (x, y) in enumerate(zip(g, w)) if x != y), None)
        if d is None:
            assert len(g) == len(w)
            continue
        if ref is None:
            ref = Engine(plain_eng.art.path, backend="reference", max_context=400, max_seqs=1, prefill_chunk=16)
        logits = ref.score(p + w[:d])[-1].float()
        gap = abs(logits[w[d]] - logits[g[d]]).item()
        assert gap <= 2 * atol, (f"prompt {i}: speculative parts from plain at token {d} ({g[d]} for {w[d]}), "
                                 f"fp32 logits {gap:.3f} apart")
    if ref is not None:
        ref.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_agrees_with_plain_decoding(engines, kind, k):
    plain, spec = engines(kind), engines(kind, k)
    ps = prompts()
    want = [s.generated for s in plain.generate(ps, max_new=40)]
    got = [s.generated for s in spec.generate(ps, max_new=40)]
    agree_up_to_near_ties(plain, ps, got, want)
    assert spec.spec.stats["num_draft_tokens"] > 0 and spec.cache.in_use == (0, 0)
    assert spec.spec.verify[len(ps)].graph is not None   # the full-draft rounds replayed a captured round


@pytest.mark.parametrize("kind", KINDS)
def test_captured_verify_step_equals_its_launches(engines, kind):
    """The round replayed from its CUDA graph against the same VerifyStep launched op by op (cuda_graphs off): the
    same kernels on the same inputs, so the same tokens (up to near-ties, should a kernel reduce in another order)
    and the same drafts where the tokens agree."""
    ps = prompts(seed=4)
    eager = engines(kind, 3, cuda_graphs=False)
    want = [s.generated for s in eager.generate(ps, max_new=32)]
    got = [s.generated for s in engines(kind, 3).generate(ps, max_new=32)]
    assert all(v.graph is None for v in eager.spec.verify.values())
    agree_up_to_near_ties(engines(kind), ps, got, want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("wrong_at", [None, 1])
def test_injected_drafts_accept_and_roll_back(engines, kind, wrong_at):
    from ninfer.runtime.speculative import drafts_from
    plain, spec = engines(kind), engines(kind, 3)
    ps = prompts(seed=1)
    want = [s.generated for s in plain.generate(ps, max_new=40)]
    before = dict(spec.spec.stats)
    with drafts_from({tuple(p): p + w for p, w in zip(ps, want)}, wrong(wrong_at)):
        got = [s.generated for s in spec.generate(ps, max_new=40)]
    agree_up_to_near_ties(plain, ps, got, want)
    accepted = spec.spec.stats["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert accepted > (40 if wrong_at is None else 10)
    assert spec.cache.in_use == (0, 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("wrong_at", [None, 1])
def test_commit_beside_the_draft_steps(engines, kind, wrong_at, monkeypatch):
    """The round's GDN commit on its own stream beside the MTP layer and draft steps (verify_graph.COMMIT_BESIDE,
    a fork and a join inside the captured round): with drafts that hold, and with the rollback of a rejected one, the
    tokens are plain decoding's (up to near-ties); a commit that raced the next round's reads would part from it."""
    from ninfer.runtime import verify_graph
    from ninfer.runtime.engine import Engine
    from ninfer.runtime.models import blocks
    from ninfer.runtime.speculative import SpeculativeConfig, drafts_from
    plain = engines(kind)
    ps = prompts(seed=5)
    want = [s.generated for s in plain.generate(ps, max_new=40)]
    monkeypatch.setattr(verify_graph, "COMMIT_BESIDE", True)
    spec = Engine(artifact(kind), backend="cuda", max_context=400, max_seqs=4, prefill_chunk=16,
                  speculative=SpeculativeConfig("mtp", 3))
    try:
        with drafts_from({tuple(p): p + w for p, w in zip(ps, want)}, wrong(wrong_at)):
            got = [s.generated for s in spec.generate(ps, max_new=40)]
        assert spec.spec.verify[len(ps)].graph is not None and spec.cache.in_use == (0, 0)
        assert spec.spec.stats["num_accepted_tokens"] > (40 if wrong_at is None else 10)
    finally:
        spec.close()
    assert any(use == "commit" for _, use in blocks._SIDE_STREAMS)   # the round forked onto the commit stream
    agree_up_to_near_ties(plain, ps, got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_draft_vocabulary_rounds(engines, kind, monkeypatch):
    """draft_vocab_size 256 (vocab 1024): the captured rounds draft from the lm_head's first 256 rows only (two views
    of its storage, the argmax and the id map inside the graph), and the output is plain decoding's up to near-ties."""
    from ninfer.runtime.speculative import SpeculativeConfig, Speculator
    plain, spec = engines(kind), engines(kind, SpeculativeConfig("mtp", 3, draft_vocab_size=256))
    drafted = []
    monkeypatch.setattr(Speculator, "_proposed", lambda self, seqs: drafted.extend(d for s in seqs for d in s.drafts))
    ps = prompts(seed=5)
    want = [s.generated for s in plain.generate(ps, max_new=32)]
    got = [s.generated for s in spec.generate(ps, max_new=32)]
    agree_up_to_near_ties(plain, ps, got, want)
    assert len(drafted) > 30 and max(drafted) < 256 and spec.spec.verify[len(ps)].graph is not None


def test_draft_head_rounds(engines, monkeypatch):
    """An artifact's own draft head (dense.draft: q4 rows of 256 ids ranked by a corpus of high ids, make_oracle.py)
    with draft_vocab_size 256: the captured rounds draft only its ids (the GEMV over its rows, the argmax and the id
    map inside the graph), and the output is plain decoding's up to near-ties."""
    from ninfer.runtime.speculative import SpeculativeConfig, Speculator
    plain, spec = engines("dense.draft"), engines("dense.draft", SpeculativeConfig("mtp", 3, draft_vocab_size=256))
    drafted = []
    monkeypatch.setattr(Speculator, "_proposed", lambda self, seqs: drafted.extend(d for s in seqs for d in s.drafts))
    ps = [[t % 1000 for t in p] for p in prompts(seed=6)]   # ids of its 1000-word tokenizer
    want = [s.generated for s in plain.generate(ps, max_new=32)]
    got = [s.generated for s in spec.generate(ps, max_new=32)]
    agree_up_to_near_ties(plain, ps, got, want)
    ids = set(spec.spec.draft_vocab.ids.tolist())
    assert len(drafted) > 30 and set(drafted) <= ids and max(drafted) > 500 and spec.spec.verify[len(ps)].graph is not None


@pytest.mark.parametrize("kind", KINDS)
def test_mtp_layer_agrees_with_the_reference_backend(engines, kind):
    """The MTP layer's outputs over one prompt's pairs, cuda against the reference backend (fp32 on the CPU,
    weights from the same artifact), within model_bf16."""
    outs = {}
    for backend in ("cuda", "reference"):
        eng = engines(kind, 3, backend)
        got, real = [], eng.spec._mtp
        eng.spec._mtp = lambda *a: got.append(real(*a)) or got[-1]
        try:
            seq = eng.open(prompts(seed=2)[2], max_new=8)
            eng.prefill(seq)
            eng.release(seq)
        finally:
            del eng.spec._mtp
        outs[backend] = got[0].float().cpu()
    preset = engines(kind).be.manifest.tolerances["model_bf16"]
    verdict = compare(outs["cuda"], outs["reference"], preset)
    assert verdict.ok, verdict


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_ngram_rounds_agree_with_plain_decoding(engines, kind):
    """Prompt-lookup drafts (any family): long random prompts, so many rounds verify drafts, often fewer than K (padded
    rows in the captured round)."""
    from ninfer.runtime.speculative import SpeculativeConfig
    plain = engines(kind)
    spec = engines(kind, SpeculativeConfig("ngram", 3, 2, 1))   # one-token lookups: more rounds with drafts
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (300, 250, 280)]
    want = [s.generated for s in plain.generate(ps, max_new=24)]
    got = [s.generated for s in spec.generate(ps, max_new=24)]
    agree_up_to_near_ties(plain, ps, got, want)
    assert spec.spec.stats["num_drafts"] >= 8 and spec.spec.verify[3].graph is not None


def test_mixed_batch_of_greedy_and_sampling_lanes(engines):
    """Seeded sampling lanes go through the rounds beside greedy ones (each verify row drawn with its position's
    counter): every lane gets its tokens, the greedy ones plain decoding's up to near-ties (the sampled ones may part
    where bf16 logits move a draw across a boundary)."""
    from ninfer.runtime.engine import SamplingParams
    plain, spec = engines("dense"), engines("dense", 3)
    ps = prompts(seed=3)
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(),
              SamplingParams(temperature=0.7, top_k=5, seed=4)]
    want = plain.generate(ps, max_new=24, sampling=params)
    got = spec.generate(ps, max_new=24, sampling=params)
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0]
    agree_up_to_near_ties(plain, [ps[i] for i in greedy], [got[i].generated for i in greedy],
                          [want[i].generated for i in greedy])
    assert all(len(s.generated) == 24 for s in got) and spec.cache.in_use == (0, 0)
