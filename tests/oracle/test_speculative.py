"""Speculative decoding with the MTP layer (runtime/speculative.py), reference backend, tiny checkpoints.

The MTP layer against transformers 5.24's generic MtpModel (the checkpoint's mtp.* mapped onto it); greedy output
through speculative rounds identical to plain greedy decoding, with the MTP layer's own drafts (random weights: they
are rejected) and with drafts injected from the known continuation (accepted whole, or up to a wrong one: the GDN
rollback path); sampling and penalties (the same draws as plain decoding); finishing inside a round, prefix caching
after it; bad configurations refused."""
import re

import pytest
import torch

from ninfer.runtime.convert import convert, plan_conversion
from ninfer.runtime.engine import Engine, EngineError, SamplingParams
from ninfer.runtime.manifest import Manifest
from ninfer.runtime.speculative import SpeculativeConfig, SpeculativeConfigError, drafts_from
from ninfer.runtime.tolerance import compare
from tests.fixtures.tiny_checkpoints import build

PRESET = Manifest.load().tolerances["model_fp32"]
MTP = SpeculativeConfig("mtp", 3)


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    """kind -> (checkpoint dir, fp32 artifact), built lazily."""
    root, cache = tmp_path_factory.mktemp("spec"), {}

    def get(kind):
        if kind not in cache:
            d = build(kind, root / "ckpt")
            convert(plan_conversion(d, fmt="fp32"), root / f"{kind}.ninfer")
            cache[kind] = d, root / f"{kind}.ninfer"
        return cache[kind]
    return get


@pytest.fixture(scope="module")
def ckpt(kinds):
    return kinds("dense")


def prompts(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1024, (n,), generator=g).tolist() for n in lengths]


def engine(art, spec=MTP, **kw):
    kw = {"backend": "reference", "max_context": 128, "max_seqs": 4, "prefill_chunk": 7, **kw}
    return Engine(art, speculative=spec, **kw)


def plain(art, ps, max_new, **kw):
    eng = engine(art, None)
    return [s.generated for s in eng.generate(ps, max_new=max_new, **kw)]


@pytest.mark.parametrize("kind,cls", [("dense", "Qwen3_5ForCausalLM"), ("moe", "Qwen3_5MoeForCausalLM"),
                                      ("moe_fused", "Qwen3_5MoeForCausalLM")])
def test_mtp_layer_matches_transformers(kinds, kind, cls):
    """Our MTP layer over a prompt's pairs (h_t, token t+1) = MtpModel.forward_layer (positions t for both), and its
    last row's argmax is the first draft; the next two draft steps likewise."""
    import transformers
    from safetensors.torch import load_file
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel
    d, art = kinds(kind)
    cfg = transformers.AutoConfig.from_pretrained(d)
    cfg = getattr(cfg, "text_config", cfg)
    cfg.num_mtp_layers, cfg.mtp_layer_types = 1, ["full_attention"]
    main = getattr(transformers, cls).from_pretrained(d, config=cfg, dtype=torch.float32).eval()
    mtp = MtpModel(main, 1).eval()
    names = {"mtp.fc.": "layers.0.eh_proj.", "mtp.pre_fc_norm_embedding.": "layers.0.enorm.",
             "mtp.pre_fc_norm_hidden.": "layers.0.hnorm.", "mtp.norm.": "layers.0.post_norm.",
             "mtp.layers.0.": "layers.0.mtp_block."}
    sd, experts = {}, {}
    for k, v in load_file(str(d / "mtp.safetensors")).items():
        head = next(p for p in names if k.startswith(p))
        k = names[head] + k[len(head):]
        m = re.match(r"(.*mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", k)
        if m:   # per-expert names on disk, fused parameters in the HF MoE block
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = v.float()
        else:
            sd[k] = v.float()
    for k, per in experts.items():
        sd[k + ".gate_up_proj"] = torch.stack([torch.cat([per[e]["gate"], per[e]["up"]]) for e in sorted(per)])
        sd[k + ".down_proj"] = torch.stack([per[e]["down"] for e in sorted(per)])
    missing, unexpected = mtp.load_state_dict(sd, strict=False)
    assert not unexpected and all(m.startswith(("embed_tokens", "shared_head", "rotary_emb")) for m in missing)

    eng = engine(art, prefill_chunk=64)
    got = []
    real = eng.spec._mtp
    eng.spec._mtp = lambda *a: got.append(real(*a)) or got[-1]
    (p,) = prompts(23, seed=5)
    seq = eng.open(p, max_new=8)
    assert eng.prefill(seq)
    n = len(p)
    cache = MtpCache(config=cfg.get_mtp_config())
    with torch.no_grad():
        h = main.model(torch.tensor([p])).last_hidden_state
        ref = mtp.forward_layer(0, h, torch.arange(n)[None], cache, input_ids=torch.tensor([seq.tokens[1:n + 1]]))
        first = int(main.lm_head(ref[0, -1]).argmax())
        # the next draft step pairs that output with the draft, one position on, over the same MTP cache
        ref2 = mtp.forward_layer(0, ref[:, -1:], torch.tensor([[n]]), cache, input_ids=torch.tensor([[first]]))
        second = int(main.lm_head(ref2[0, -1]).argmax())
        ref3 = mtp.forward_layer(0, ref2[:, -1:], torch.tensor([[n + 1]]), cache, input_ids=torch.tensor([[second]]))
        third = int(main.lm_head(ref3[0, -1]).argmax())
    assert all(compare(g, r[0], PRESET).ok for g, r in zip(got, (ref, ref2, ref3)))
    assert seq.drafts == [first, second, third]
    eng.release(seq)


@pytest.mark.parametrize("kind,k", [("dense", 1), ("dense", 3), ("dense", 5), ("moe", 3)])
def test_greedy_identical_to_plain_decoding(kinds, kind, k):
    _, art = kinds(kind)
    ps = prompts(9, 17, 4)
    ref = plain(art, ps, 24)
    eng = engine(art, SpeculativeConfig("mtp", k))
    assert [s.generated for s in eng.generate(ps, max_new=24)] == ref
    st = eng.spec.stats
    assert st["num_drafts"] > 0 and st["num_draft_tokens"] > st["num_drafts"] * (k > 1)
    assert 3 in eng.spec.verify   # rounds of full drafts ran the static verify step
    assert eng.cache.in_use == (0, 0)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_static_round_drafts_what_the_op_by_op_round_drafts(kinds, kind):
    """The VerifyStep round (verify, draws, acceptance count and MTP steps over static buffers, the GPU's CUDA graph)
    against the op-by-op round, greedy and seeded sampling lanes: the same tokens (plain decoding's) and, round by
    round, the same drafts for every lane."""
    _, art = kinds(kind)
    ps = prompts(9, 17, 4, seed=6)
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=6)]
    ref = [s.generated for s in engine(art, None).generate(ps, max_new=24, sampling=params)]
    logs = {}
    for static in (True, False):
        eng = engine(art)
        eng.spec.static = static
        log = logs[static] = []
        eng.spec._proposed = lambda seqs, log=log: log.extend((tuple(s.prompt), len(s.tokens), list(s.drafts))
                                                               for s in seqs)
        assert [s.generated for s in eng.generate(ps, max_new=24, sampling=params)] == ref
        assert bool(eng.spec.verify) == static and eng.cache.in_use == (0, 0)
    assert len(logs[True]) > 20 and logs[True] == logs[False]


@pytest.mark.parametrize("fmt", ["fp32", "q4"])
def test_draft_vocabulary_argmax_reads_only_its_rows(fmt):
    """DraftVocab over a [1024, 128] lm_head (a tensor, or packed q4 read by linear_q4) whose last 24 rows are padding
    (domain 1000): ids below 200 rounded up to 256 and the tile of the added tokens 990 and 995 (896..999). Its
    argmax equals the whole head's argmax with every other id masked, row by row, for rows whose winner lies on
    either side of the cut."""
    from ninfer.runtime.dispatch import backend
    from ninfer.runtime.models.blocks import linear
    from ninfer.runtime.speculative import DraftVocab
    from ninfer.runtime.weights import random_packed
    g = torch.Generator().manual_seed(3)
    head = (torch.randn(1024, 128, generator=g) if fmt == "fp32"
            else random_packed("q4", (1024, 128), "cpu", g, std=1.0))
    be, hidden = backend("reference"), torch.randn(64, 128, generator=g)
    dv = DraftVocab.from_lm_head(head, 200, [2, 990, 995], domain=1000)
    got = torch.empty(64, dtype=torch.int32)
    dv.argmax(be, hidden, got)
    full = linear(be, hidden, head).clone()
    allowed = torch.zeros(1024, dtype=torch.bool)
    allowed[:256] = allowed[896:1000] = True
    want = full.masked_fill(~allowed, float("-inf")).argmax(1).int()
    assert torch.equal(got, want)
    assert (want < 256).any() and (want >= 896).any() and (full[:, :1000].argmax(1) != want).any()
    with pytest.raises(SpeculativeConfigError, match="whole vocabulary"):
        DraftVocab.from_lm_head(head, 1000, [], domain=1000)


def test_draft_vocabulary_drafts_inside_it_and_output_unchanged(ckpt, monkeypatch):
    """draft_vocab_size 256 on the tiny dense model (vocab 1024, no added tokens): greedy output identical to plain
    decoding, static and op-by-op rounds propose the same drafts, every one below 256, where the whole head's drafts
    for the same prompts are not."""
    from ninfer.runtime.speculative import Speculator
    _, art = ckpt
    ps = prompts(9, 17, 4, seed=8)
    ref = plain(art, ps, 24)
    logs = {}
    for name, spec, static in (("full", MTP, True), ("static", SpeculativeConfig("mtp", 3, draft_vocab_size=256), True),
                               ("op", SpeculativeConfig("mtp", 3, draft_vocab_size=256), False)):
        log = logs[name] = []
        monkeypatch.setattr(Speculator, "_proposed", lambda self, seqs, log=log: log.extend(
            (tuple(s.prompt), len(s.tokens), list(s.drafts)) for s in seqs))
        eng = engine(art, spec)
        eng.spec.static = static
        assert [s.generated for s in eng.generate(ps, max_new=24)] == ref
        assert bool(eng.spec.verify) == static and eng.cache.in_use == (0, 0)
    drafted = lambda name: [d for _, _, ds in logs[name] for d in ds]   # noqa: E731
    assert len(logs["static"]) > 10 and logs["static"] == logs["op"]
    assert max(drafted("static")) < 256 and max(drafted("full")) >= 256


def test_the_verify_steps_draft_rows_are_16_byte_aligned(ckpt):
    """The captured round writes draft j of every lane through argmax's ids pointer, which the cuda backend requires
    16-byte aligned: with 1 and 3 lanes too (a row of 1 or 3 int32 would put row 1 at 4 or 12 bytes)."""
    from ninfer.runtime.verify_graph import VerifyStep
    eng = engine(ckpt[1])
    for b in (1, 3, 4):
        vs = VerifyStep(eng, b, 4, False, torch.zeros(16, 1024, dtype=torch.int32), eng.spec.draft)
        assert vs.drafts.shape == (3, b) and all(vs.drafts[j].data_ptr() % 16 == 0 for j in range(3))
    eng.close()


def test_lanes_share_the_free_pages_of_a_round(ckpt):
    """Two lanes whose rounds each want a new KV page, one page free (a 3-page pool): the first lane verifies its
    three drafts, the second only the one its own page still holds (the others would need the page the first took),
    instead of running out of pages mid-round (ninfer-bench spec, 27B at C = 8 on the H100); both keep plain
    decoding's tokens."""
    _, art = ckpt
    ps = prompts(14, 14, seed=9)
    ref = plain(art, ps, 6)
    eng = engine(art, MTP, kv_capacity=3, page_size=16)
    seqs = [eng.open(p, max_new=6) for p in ps]
    with drafts_from({tuple(p): p + r for p, r in zip(ps, ref)}):
        for s in seqs:
            while not eng.prefill(s):
                pass
        assert [len(s.pages) for s in seqs] == [1, 1] and eng.cache.available_pages == 1   # positions 0..14 each
        eng.decode(seqs)   # lane 0: positions 14..17 (a new page); lane 1: 14..15, what its first page holds
        assert [s.n_generated for s in seqs] == [5, 3] and eng.cache.available_pages == 0
        assert [s.generated for s in seqs] == [ref[0][:5], ref[1][:3]]
    for s in seqs:
        eng.release(s)
    eng.close()


def test_draft_head_argmax_maps_its_rows_to_their_ids():
    """DraftVocab over an artifact's draft head (packed q4, 512 rows, their ids a permutation of 0..999): draft size
    200 reads its first 256 rows; a draft is the id of the highest of those rows' logits. A size beyond the head's
    rows, or an id outside the tokenizer's domain, is refused."""
    from ninfer.runtime.dispatch import backend
    from ninfer.runtime.models.blocks import linear
    from ninfer.runtime.speculative import DraftVocab
    from ninfer.runtime.weights import random_packed
    g = torch.Generator().manual_seed(4)
    head, ids = random_packed("q4", (512, 128), "cpu", g, std=1.0), torch.randperm(1000, generator=g)[:512].tolist()
    be, hidden = backend("reference"), torch.randn(64, 128, generator=g)
    dv = DraftVocab.from_draft_head(head, ids, 200, domain=1000)
    got = torch.empty(64, dtype=torch.int32)
    dv.argmax(be, hidden, got)
    rows = linear(be, hidden, head)[:, :256].argmax(1)
    assert got.tolist() == [ids[r] for r in rows.tolist()] and len(set(rows.tolist())) > 10
    with pytest.raises(SpeculativeConfigError, match="more than the artifact's draft head holds"):
        DraftVocab.from_draft_head(head, ids, 513, domain=1000)
    with pytest.raises(SpeculativeConfigError, match="outside the 999"):
        DraftVocab.from_draft_head(head, [999] + ids[1:], 128, domain=999)


def test_the_artifacts_draft_head_drafts_its_ids_and_output_is_unchanged(tmp_path, monkeypatch):
    """A tiny dense artifact converted with --draft-vocab-size 128 over a corpus that ranks high ids first (a 1000-word
    tokenizer): with draft_vocab_size 128 the engine loads the draft head (only then) and drafts only its ids, among
    them ids a prefix of the lm_head would not hold; greedy output identical to plain decoding."""
    from ninfer.runtime.draft_head import DRAFT_HEAD, add_draft_head
    from ninfer.runtime.speculative import Speculator
    from tests.fixtures.tiny_checkpoints import with_word_tokenizer
    d = with_word_tokenizer(build("dense", tmp_path / "ckpt"), tmp_path / "words")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{i}" for i in range(999, 500, -7)), encoding="utf-8")   # 72 ids above 500
    plan = plan_conversion(d, fmt="fp32")
    add_draft_head(plan, 128, [corpus])
    convert(plan, tmp_path / "a.ninfer")
    plan.checkpoint.close()
    art = tmp_path / "a.ninfer"
    ps = [[t % 1000 for t in p] for p in prompts(9, 17, 4, seed=8)]   # ids the 1000-word tokenizer has
    ref = plain(art, ps, 24)
    drafted = []
    monkeypatch.setattr(Speculator, "_proposed", lambda self, seqs: drafted.extend(d for s in seqs for d in s.drafts))
    eng = engine(art, SpeculativeConfig("mtp", 3, draft_vocab_size=128))
    ids = set(eng.spec.draft_vocab.ids.tolist())
    assert len(ids) == 128 and {1000, 1001, 999, 992} <= ids and max(ids) > 900
    assert [s.generated for s in eng.generate(ps, max_new=24)] == ref
    assert len(drafted) > 10 and set(drafted) <= ids and any(x >= 128 for x in drafted)
    mtp_only = engine(art)
    assert DRAFT_HEAD in eng.weights and DRAFT_HEAD not in mtp_only.weights
    eng.close()
    mtp_only.close()
    with pytest.raises(SpeculativeConfigError, match="more than the artifact's draft head holds"):
        engine(art, SpeculativeConfig("mtp", 3, draft_vocab_size=256))


def test_a_synthetic_draft_head_is_drafted_from(ckpt):
    """ninfer-bench spec --draft-head: random weights with a q4 draft head of 128 rows (ids = row numbers) at the tiny
    dense shape; the engine drafts from it (its rows, not a view of the lm_head) and keeps plain decoding's output."""
    from ninfer.runtime.draft_head import DRAFT_HEAD
    from ninfer.runtime.artifact import open_artifact
    from ninfer.runtime.models.blocks import dequant_scratch_bytes
    from ninfer.runtime.models.config import parse_config
    from ninfer.runtime.synthetic import random_weights
    with open_artifact(ckpt[1]) as a:
        cfg = parse_config(a.resource("config.json"))
    ps = prompts(9, 5, seed=3)
    outs = {}
    for name, spec in (("plain", None), ("head", SpeculativeConfig("mtp", 3, draft_vocab_size=128))):
        w = random_weights(cfg, "cpu", torch.float32, seed=1, fmt="bf16", mtp=True, draft_rows=128)
        assert dequant_scratch_bytes(w) == 0   # the draft head (the one packed matrix here) is never decoded
        eng = Engine.from_weights(cfg, w, backend="reference", max_context=64, max_seqs=2, speculative=spec)
        outs[name] = [s.generated for s in eng.generate(ps, max_new=12)]
        if spec:
            (rows, _), = eng.spec.draft_vocab.parts
            assert rows is w[DRAFT_HEAD] and eng.spec.draft_vocab.ids.tolist() == list(range(128))
            assert eng.spec.stats["num_draft_tokens"] > 0
    assert outs["plain"] == outs["head"]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_verify_attention_keeps_output_and_drafts(kinds, kind, monkeypatch):
    """NINFER_ATTN_VERIFY's path (the static round's attention layers, the MTP layer's too, as paged_attention_verify
    over each lane's K + 1 rows): the tokens plain decoding's, and the drafts those of the rounds without it."""
    from ninfer.runtime.models import blocks
    _, art = kinds(kind)
    ps = prompts(9, 17, 4, seed=7)
    ref = plain(art, ps, 24)
    logs, calls = {}, []
    for on in (False, True):
        monkeypatch.setattr(blocks, "ATTN_VERIFY", on)
        eng = engine(art)
        log = logs[on] = []
        eng.spec._proposed = lambda seqs, log=log: log.extend((tuple(s.prompt), len(s.tokens), list(s.drafts))
                                                               for s in seqs)
        run = eng.be.run
        eng.be.run = lambda op, **kw: (calls.append((on, op)) if op == "paged_attention_verify" else None) or run(op, **kw)
        assert [s.generated for s in eng.generate(ps, max_new=24)] == ref
    assert len(logs[True]) > 10 and logs[True] == logs[False]
    assert calls and all(on for on, _ in calls)


def test_static_round_accepts_sampled_drafts_that_hold(ckpt):
    """Seeded sampling lanes through the static round with drafts from their plain continuation: every draft equals
    the draw at its row (the same counter as plain decoding's), so all are accepted and the tokens are plain's."""
    _, art = ckpt
    ps = prompts(9, 17, seed=8)
    params = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=6)]
    ref = [s.generated for s in engine(art, None).generate(ps, max_new=30, sampling=params)]
    eng = engine(art)
    with drafts_from(known(ps, ref)):
        assert [s.generated for s in eng.generate(ps, max_new=30, sampling=params)] == ref
    st = eng.spec.stats
    assert 2 in eng.spec.verify and st["num_accepted_tokens"] == st["num_draft_tokens"] > 20


def wrong(at):
    """A change of the draft at index `at` (when a round drafts that many): the rounds accept up to it."""
    def alter(drafts):
        if at < len(drafts):
            drafts[at] = (drafts[at] + 1) % 1024
    return None if at is None else alter


def known(ps, refs):
    """drafts_from's map: each prompt -> prompt + its plain continuation."""
    return {tuple(p): p + r for p, r in zip(ps, refs)}


@pytest.mark.parametrize("kind,wrong_at", [("dense", None), ("dense", 0), ("dense", 1), ("dense", 2), ("moe", None),
                                           ("moe", 1)])
def test_injected_drafts_are_accepted_and_rejections_roll_back(kinds, kind, wrong_at):
    _, art = kinds(kind)
    ps = prompts(9, 17, 4, seed=3)
    ref = plain(art, ps, 30)
    eng = engine(art)
    with drafts_from(known(ps, ref), wrong(wrong_at)):
        seqs = eng.generate(ps, max_new=30)
    assert [s.generated for s in seqs] == ref
    st, per_pos = eng.spec.stats, eng.spec.accepted_per_pos
    if wrong_at is None:   # every draft accepted: a round commits K + 1 tokens
        assert st["num_accepted_tokens"] == st["num_draft_tokens"] > 0
        assert st["num_drafts"] <= 3 * (1 + -(-29 // 4))
    else:   # the drafts before the wrong one, never it or the ones after it (rejections: rolled-back lanes)
        assert per_pos[wrong_at:] == [0] * (3 - wrong_at) and all(n > 0 for n in per_pos[:wrong_at])
        assert st["num_accepted_tokens"] < st["num_draft_tokens"]
    assert eng.cache.in_use == (0, 0)


def test_stop_token_inside_a_round_then_prefix_caching(ckpt):
    """A stop token among accepted drafts ends the sequence there; the lane retained for prefix caching then holds
    exactly the tokens it kept (its GDN state rolled back to them): the next turn equals a fresh engine's."""
    _, art = ckpt
    (p,) = prompts(11, seed=7)
    ref = plain(art, [p], 20)[0]
    stop = ref[9]
    upto = ref[:ref.index(stop) + 1]
    eng = engine(art, prefix_caching=True)
    with drafts_from(known([p], [ref])):
        (seq,) = eng.generate([p], max_new=20, stop_ids=[stop])
    assert seq.generated == upto and seq.finish_reason == "stop"
    turn2 = p + upto + prompts(5, seed=8)[0]
    again = eng.generate([turn2], max_new=12)[0]
    assert again.cached > len(p)                  # the retained lane served the prefix
    assert again.generated == plain(art, [turn2], 12)[0]


def test_max_new_and_context_limits_bound_the_drafts(ckpt):
    _, art = ckpt
    ps = prompts(9, 17, seed=4)
    ref = plain(art, ps, 40)
    with drafts_from(known(ps, ref)):
        for max_new in (1, 2, 5, 6):
            eng = engine(art)
            assert [s.generated for s in eng.generate(ps, max_new=max_new)] == [r[:max_new] for r in ref]
        eng = engine(art, max_context=24)   # the 17-token prompt reaches the context limit
        got = eng.generate(ps, max_new=40)
    assert [s.generated for s in got] == [r[:24 - len(p)] for p, r in zip(ps, ref)]
    assert [s.finish_reason for s in got] == ["length", "length"]


@pytest.mark.parametrize("injected", [False, True])
def test_sampling_and_penalties_draw_what_plain_decoding_draws(ckpt, injected):
    """Lanes that sample (seeded) or apply penalties: each verify row is drawn with the counter and penalty counts
    its token has in plain decoding, so the tokens are plain decoding's, with the MTP layer's drafts and with drafts
    from the known continuation (accepted: the draw equals the draft)."""
    _, art = ckpt
    ps = prompts(9, 13, 6, 11, seed=2)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=11),
              SamplingParams(presence_penalty=1.0, frequency_penalty=0.5),
              SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, presence_penalty=0.5, seed=3)]
    ref = [s.generated for s in engine(art, None).generate(ps, max_new=20, sampling=params)]
    eng = engine(art)
    with drafts_from(known(ps, ref) if injected else {}):
        assert [s.generated for s in eng.generate(ps, max_new=20, sampling=params)] == ref
    st = eng.spec.stats
    assert st["num_drafts"] > 0 and (not injected or st["num_accepted_tokens"] == st["num_draft_tokens"])


def test_bad_configurations_are_refused(ckpt, tmp_path):
    d, _ = ckpt
    for bad in ('{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"num_speculative_tokens": 9}',
                '{"num_speculative_tokens": "3"}', '{"model": "x"}', '[3]', 'mtp', '{"prompt_lookup_max": 3}',
                '{"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}',
                '{"method": "ngram", "prompt_lookup_max": 0}', '{"method": "ngram", "prompt_lookup_max": 17}',
                '{"method": "ngram", "draft_vocab_size": 4096}', '{"draft_vocab_size": 0}', '{"draft_vocab_size": 1.5}'):
        with pytest.raises(SpeculativeConfigError):
            SpeculativeConfig.parse(bad)
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}') == SpeculativeConfig("mtp", 2)
    assert SpeculativeConfig.parse('{"method": "ngram"}') == SpeculativeConfig("ngram", 3, 4, 2)
    assert SpeculativeConfig.parse('{"draft_vocab_size": 131072}') == SpeculativeConfig("mtp", 3, draft_vocab_size=131072)
    with pytest.raises(SpeculativeConfigError, match="whole vocabulary"):
        engine(ckpt[1], SpeculativeConfig("mtp", 3, draft_vocab_size=1024))
    assert SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_max": 1}') == SpeculativeConfig("ngram", 3, 1, 1)
    no_mtp = tmp_path / "no_mtp.ninfer"
    convert(plan_conversion(d, fmt="fp32", skip=("mtp",)), no_mtp)
    with pytest.raises(EngineError, match="MTP layer"):
        engine(no_mtp)


class IdText:
    """A detokenizer that writes token t as "<t>" (a stop string can then name any token)."""

    def push(self, tok: int) -> str:
        return f"<{tok}>"

    def finish(self) -> str:
        return ""


def test_scheduler_events_and_stop_strings_inside_rounds(ckpt):
    """Through the scheduler: a round's tokens arrive as one event (its token count), the text is every token's; a
    stop string completed by a token inside a round ends the request there, reporting the tokens up to it."""
    import asyncio

    from ninfer.runtime import scheduler as S
    _, art = ckpt
    (p,) = prompts(10, seed=9)
    ref = plain(art, [p], 24)[0]
    eng = engine(art)

    async def run(stops):
        s = S.Scheduler(eng)
        try:
            h = s.submit(S.Request(prompt=p, max_new=24, stop_strings=tuple(stops), detokenizer=IdText()))
            evs = [ev async for ev in h]
            return [e for e in evs if isinstance(e, S.Text)], evs[-1]
        finally:
            s.close()
    with drafts_from(known([p], [ref])):
        texts, done = asyncio.run(run(()))
    assert "".join(t.text for t in texts) == "".join(f"<{t}>" for t in ref) and done.completion_tokens == 24
    assert sum(t.tokens for t in texts) == 24 and max(t.tokens for t in texts) == 4   # K + 1 a round
    # a token first seen in the middle of a round (the first token comes from prefill; rounds then give 4 each)
    i = next(i for i in range(10, 24) if ref[i] not in ref[:i] and i % 4 != 0)
    with drafts_from(known([p], [ref])):
        texts, done = asyncio.run(run([f"<{ref[i]}>"]))
    assert "".join(t.text for t in texts) == "".join(f"<{t}>" for t in ref[:i])
    assert done.finish_reason == "stop" and done.completion_tokens == i + 1
    assert eng.cache.in_use == (0, 0)


def test_bench_spec_runs_the_three_modes(ckpt):
    """`ninfer-bench spec`'s measurement (run here on the reference backend, tiny model): plain decoding commits a
    token a call per lane, the MTP layer's random drafts about as much, drafts from the known continuation K + 1."""
    from ninfer.cli.bench_spec import PROFILE_CALLS, bench_spec
    _, art = ckpt
    eng = engine(art, max_context=200)
    lines, profiled = [], []

    def profile(seqs, secs):   # as --profile's: more decode calls on the live sequences, after the timed ones
        profiled.append((len(seqs), secs > 0, eng.spec is not None))
        for _ in range(PROFILE_CALLS):
            eng.decode(seqs)
    rows = bench_spec(eng.cfg, eng, [1, 2], 12, rounds=4, k=3, fmt="bf16", copy_gbs=None, echo=lines.append,
                      profile=profile)
    got = {(r["concurrency"], r["mode"]): r for r in rows}
    assert len(got) == 6 and len(lines) == 10
    assert profiled == [(c, True, spec) for c in (1, 2) for spec in (False, True, True)]
    for c in (1, 2):
        assert got[c, "plain"]["tokens_per_call"] == c and got[c, "plain"]["acceptance"] is None
        assert c <= got[c, "mtp drafts"]["tokens_per_call"] < 2 * c
        assert got[c, "known drafts"]["tokens_per_call"] == 4 * c and got[c, "known drafts"]["acceptance"] == 1.0
        known = got[c, "known drafts"]
        assert known["projected_tok_s"]["0.80"] == pytest.approx(c * (1 + 3 * 0.8) / (known["call_ms"] / 1e3))
    assert eng.cache.in_use == (0, 0)


# -- n-gram drafts (prompt lookup) -------------------------------------------------------------------------------
NGRAM = SpeculativeConfig("ngram", 3, 4, 2)


def test_ngram_index_proposes_what_followed_the_latest_match():
    from ninfer.runtime.speculative import NgramIndex
    idx = NgramIndex(2, 3)
    toks = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6]
    assert idx.propose(toks, 3) == [7, 1, 2]          # [5, 6] last ended at index 6 (then 7, 1, 2)
    toks += [7]
    assert idx.propose(toks, 2) == [1, 2]             # [5, 6, 7] at 5..7: the 3-gram wins
    assert idx.propose(toks + [4], 3) == []           # [7, 4] and [6, 7, 4] never seen
    assert NgramIndex(2, 4).propose([1, 2, 3, 1, 2], 8) == [3, 1, 2, 3, 1, 2, 3, 1]   # on periodically past the end
    assert NgramIndex(2, 4).propose([3], 2) == [] and NgramIndex(1, 1).propose([4, 4], 3) == [4, 4, 4]


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_ngram_rounds_equal_plain_decoding(kinds, kind):
    """Any family (no MTP layer needed), greedy, seeded sampling and penalty lanes. Long random prompts and one-token
    lookups: most tokens the model writes occurred before, so most rounds verify (mostly wrong) drafts, often fewer
    than K (padded rows in the static round)."""
    _, art = kinds(kind)
    ps = prompts(300, 250, 280, seed=10)
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=2), SamplingParams(presence_penalty=0.5)]
    ref = [s.generated for s in engine(art, None, max_context=400).generate(ps, max_new=16, sampling=params)]
    eng = engine(art, SpeculativeConfig("ngram", 3, 2, 1), max_context=400)
    assert [s.generated for s in eng.generate(ps, max_new=16, sampling=params)] == ref
    assert eng.spec.stats["num_drafts"] >= 8 and eng.cache.in_use == (0, 0)


def test_ngram_drafts_hold_on_the_demo_model(demo_artifact):
    """The demo model (random weights) answers greedily with one repeated token: n-gram drafts then hold, so rounds
    commit up to K + 1 tokens, including the padded rows of lanes with fewer drafts (never accepted)."""
    from ninfer.runtime.tokenizer import Tokenizer
    eng = Engine(demo_artifact, backend="reference", max_context=128, max_seqs=2, speculative=NGRAM)
    plain_eng = Engine(demo_artifact, backend="reference", max_context=128, max_seqs=2)
    ids = Tokenizer.from_artifact(eng.art).encode("Once upon a time")
    want = plain_eng.generate([ids], max_new=24)[0].generated
    got = eng.generate([ids], max_new=24)[0]
    assert got.generated == want
    st = eng.spec.stats
    assert st["num_accepted_tokens"] >= 0.5 * st["num_draft_tokens"] > 0 and 1 in eng.spec.verify
    eng.close()
    plain_eng.close()


def test_draft_vocabulary_on_the_demo_model(demo_artifact, monkeypatch):
    """The demo model (the real Qwen3.5 tokenizer, 248077 ids in 248320 tied embedding rows, an MTP layer):
    draft_vocab_size 131072 drafts over ids below 131072 and the tile rows 247936.. up to the domain, which hold its
    33 added tokens (<|im_end|>, <think>, the tool-call tags, ...); greedy output identical to plain decoding."""
    from ninfer.runtime.speculative import Speculator
    from ninfer.runtime.tokenizer import Tokenizer
    eng = Engine(demo_artifact, backend="reference", max_context=128, max_seqs=2,
                 speculative=SpeculativeConfig("mtp", 3, draft_vocab_size=131072))
    plain_eng = Engine(demo_artifact, backend="reference", max_context=128, max_seqs=2)
    dv, end = eng.spec.draft_vocab, Tokenizer.from_artifact(eng.art).encode("<|im_end|>")[0]
    assert [k for _, k in dv.parts] == [131072, eng.domain - 247936] and end in dv.ids.tolist()
    assert dv.ids.tolist() == [*range(131072), *range(247936, eng.domain)]
    drafted = []
    monkeypatch.setattr(Speculator, "_proposed", lambda self, seqs: drafted.extend(d for s in seqs for d in s.drafts))
    ids = Tokenizer.from_artifact(eng.art).encode("Once upon a time")
    assert eng.generate([ids], max_new=16)[0].generated == plain_eng.generate([ids], max_new=16)[0].generated
    assert drafted and all(d < 131072 or 247936 <= d < eng.domain for d in drafted)
    eng.close()
    plain_eng.close()


@pytest.mark.parametrize("kind,spec", [("dense", MTP), ("dense", NGRAM), ("demo", NGRAM)])
def test_lane_state_after_rounds_equals_plain_decodings(kinds, demo_artifact, kind, spec):
    """The GDN states a finished lane keeps (prefix caching: its state after all its tokens but the last) equal the
    plain engine's: every round's rollback left the state at exactly the tokens it committed (the outputs alone could
    not tell, where a model repeats itself)."""
    art = demo_artifact if kind == "demo" else kinds(kind)[1]
    p = prompts(12, seed=12)[0]
    engines = [Engine(art, backend="reference", max_context=128, max_seqs=1, prefix_caching=True, speculative=c)
               for c in (None, spec)]
    outs = [e.generate([p], max_new=20)[0].generated for e in engines]
    assert outs[0] == outs[1]
    for i, (conv, state) in engines[0].cache.gdn.items():
        other = engines[1].cache.gdn[i]
        assert torch.allclose(conv[0], other[0][0], atol=1e-5) and torch.allclose(state[0], other[1][0], atol=1e-5)
    for e in engines:
        e.close()


def test_a_failed_capture_falls_back_to_the_uncaptured_round(ckpt, monkeypatch, caplog):
    """Should capturing the static round fail on a GPU, it runs uncaptured (same results) and the log says so."""
    from ninfer.runtime import verify_graph
    _, art = ckpt
    ps = prompts(9, 13, seed=14)
    ref = plain(art, ps, 12)
    eng = engine(art)
    eng.cuda_graphs = True   # as on a GPU

    def broken(fn, warmup=None):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(verify_graph, "capture", broken)
    with caplog.at_level("ERROR", logger="ninfer.speculative"):
        assert [s.generated for s in eng.generate(ps, max_new=12)] == ref
    assert eng.spec.verify[2].graph is None and "runs uncaptured" in caplog.text
