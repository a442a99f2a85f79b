"""The models against transformers 5.24 (fp32, CPU): tiny random checkpoints saved by transformers,
converted to fp32 artifacts, run on the reference backend. Per-layer activations and logits within the
model_fp32 tolerance for several prefill chunkings; greedy generation token-identical; batching changes
nothing; bad requests are refused and leave the lanes and pages free."""
import json

import pytest
import torch

from ninfer.runtime.cache import CapacityError
from ninfer.runtime.convert import convert, plan_conversion
from ninfer.runtime.engine import Engine, EngineError
from ninfer.runtime.manifest import Manifest
from ninfer.runtime.tolerance import compare
from tests.fixtures.tiny_checkpoints import build

KINDS = ["dense", "dense_vlm", "moe", "moe_fused", "next"]
HF_CLASS = {"dense": "Qwen3_5ForCausalLM", "dense_vlm": "Qwen3_5ForCausalLM", "moe": "Qwen3_5MoeForCausalLM",
            "moe_fused": "Qwen3_5MoeForCausalLM", "next": "Qwen3NextForCausalLM"}
PRESET = Manifest.load().tolerances["model_fp32"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("oracle")


@pytest.fixture(scope="module")
def models(root):
    """kind -> (HF model, artifact path), built lazily."""
    import transformers
    cache = {}

    def get(kind):
        if kind not in cache:
            d = build(kind, root / "ckpt")
            out = root / f"{kind}.ninfer"
            convert(plan_conversion(d, fmt="fp32"), out)
            hf = getattr(transformers, HF_CLASS[kind]).from_pretrained(d, dtype=torch.float32).eval()
            cache[kind] = (hf, out)
        return cache[kind]
    return get


def prompt(n, seed):
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_layers_and_logits_match(models, kind, chunk):
    hf, art = models(kind)
    ids = prompt(37, 1)
    eng = Engine(art, backend="reference", max_context=128, prefill_chunk=chunk)
    hidden = []
    logits = eng.score(ids, hidden_out=hidden)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    for i in range(eng.cfg.layers - 1):  # transformers' last hidden state is already final-normed
        v = compare(hidden[i], out.hidden_states[i + 1][0], PRESET, f"{kind} layer {i}")
        assert v, v.detail
    v = compare(logits, out.logits[0], PRESET, f"{kind} logits")
    assert v, v.detail
    assert eng.cache.in_use == (0, 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 20])
def test_greedy_64_tokens_identical(models, kind, n):
    hf, art = models(kind)
    ids = prompt(n, 100 + n)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, n:].tolist()
    eng = Engine(art, backend="reference", max_context=256, prefill_chunk=5)
    seq = eng.generate([ids], max_new=64)[0]
    assert seq.generated == ref
    assert seq.finish_reason == "length" and seq.n_generated == 64   # max_new, counted without a copy


def greedy_ops_match_transformers(models, kind) -> list[str]:
    """Two prompts (one token; twenty, in prefill chunks of 5) decoded greedily on the reference backend: each
    sequence's 24 tokens must be transformers'. Returns the ops the engine ran, in order."""
    hf, art = models(kind)
    prompts = [prompt(1, 101), prompt(20, 120)]
    eng = Engine(art, backend="reference", max_context=128, max_seqs=2, prefill_chunk=5)
    ran, run = [], eng.be.run
    eng.be.run = lambda op, **a: (ran.append(op), run(op, **a))[1]
    seqs = eng.generate(prompts, max_new=24)
    for ids, seq in zip(prompts, seqs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert seq.generated == ref[0, len(ids):].tolist()
    return ran


@pytest.mark.parametrize("gate_add_norm", [True, False])
@pytest.mark.parametrize("kind", ["moe", "moe_fused", "next"])
def test_greedy_identical_with_and_without_the_gate_add_norm(models, kind, gate_add_norm, monkeypatch):
    """With MOE_GATE_ADD_NORM (the default) every MoE layer's shared-expert gate add runs inside the add-norm after
    it (the last layer's plain add sums it first); without, sigmoid_gate_add then add_rms_norm_zc. Each sequence's
    greedy tokens stay transformers' either way."""
    from ninfer.runtime.models import blocks
    monkeypatch.setattr(blocks, "MOE_GATE_ADD_NORM", gate_add_norm)
    ran = greedy_ops_match_transformers(models, kind)
    fused = "sigmoid_gate_add_rms_norm_zc"
    if gate_add_norm:   # the last layer's add (a MoE layer) sums the gated branch with sigmoid_gate_add
        assert "sigmoid_gate_add" in ran and ran.count(fused) > ran.count("sigmoid_gate_add")
    else:
        assert fused not in ran and "sigmoid_gate_add" in ran


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_batch_of_8_equals_each_alone(models, kind):
    _, art = models(kind)
    prompts = [prompt(3 + 5 * i, 200 + i) for i in range(8)]
    eng = Engine(art, backend="reference", max_context=128, max_seqs=8, prefill_chunk=16)
    batched = [s.generated for s in eng.generate(prompts, max_new=12)]
    alone = [eng.generate([p], max_new=12)[0].generated for p in prompts]
    assert batched == alone
    assert eng.cache.in_use == (0, 0)


def test_stop_token_ends_generation(models):
    _, art = models("dense")
    eng = Engine(art, backend="reference", max_context=128)
    ids = prompt(9, 7)
    free = eng.generate([ids], max_new=10)[0].generated
    seq = eng.generate([ids], max_new=10, stop_ids={free[3]})[0]
    assert seq.generated == free[: free.index(free[3]) + 1] and seq.finish_reason == "stop"


def test_bad_requests_are_refused_and_nothing_leaks(models):
    _, art = models("dense")
    eng = Engine(art, backend="reference", max_context=32, max_seqs=2)
    with pytest.raises(EngineError, match="empty prompt"):
        eng.generate([[]])
    with pytest.raises(EngineError, match=r"token id 1024 is outside the vocabulary \(valid ids: 0..1023\)"):
        eng.generate([[1, 2, 1024]])
    with pytest.raises(CapacityError, match="the request needs 41 tokens of context; the maximum is 32"):
        eng.generate([list(range(40))])
    with pytest.raises(EngineError, match="give 1..2 prompts, got 3"):
        eng.generate([[1], [2], [3]])
    assert eng.cache.in_use == (0, 0)
    seq = eng.generate([list(range(30))], max_new=50)[0]  # generation stops at the context limit
    assert len(seq.tokens) == 32 and seq.finish_reason == "length"
    assert eng.cache.in_use == (0, 0)


def test_unknown_family_is_refused(root, models, tmp_path):
    from ninfer.runtime.artifact import open_artifact
    from ninfer.runtime.models.config import ConfigError, parse_config
    _, art = models("dense")
    cfg = json.loads(open_artifact(art).resource("config.json"))
    cfg["model_type"] = "llama"
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        parse_config(json.dumps(cfg))


def test_seeded_sampling_is_reproducible_and_batch_independent(models):
    from ninfer.runtime.engine import SamplingParams
    _, art = models("moe")
    eng = Engine(art, backend="reference", max_context=128, max_seqs=4)
    sp = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, presence_penalty=0.5, seed=1234)
    ids = prompt(11, 9)
    alone = eng.generate([ids], max_new=16, sampling=sp)[0].generated
    assert eng.generate([ids], max_new=16, sampling=sp)[0].generated == alone
    others = [prompt(5, 1), prompt(8, 2), prompt(13, 3)]
    mixed = eng.generate([others[0], ids, others[1], others[2]], max_new=16,
                         sampling=[SamplingParams(temperature=1.2, seed=s) for s in (1, 2, 3)][:1] + [sp] +
                         [SamplingParams(temperature=0.7, seed=5), SamplingParams()])
    assert mixed[1].generated == alone
    greedy = eng.generate([ids], max_new=16)[0].generated
    assert alone != greedy  # sampling at T=0.9 over 16 tokens departs from greedy on this model
    with pytest.raises(EngineError, match="0 < top_p <= 1"):
        eng.generate([ids], sampling=SamplingParams(temperature=1.0, top_p=0.0))
    assert eng.cache.in_use == (0, 0)


def test_penalty_counts_are_each_lanes_generated_tokens(models):
    """The sample op's presence / frequency penalties read per-lane counts of the generated tokens; the engine adds
    each picked token on the device (count_tokens, one launch a step, as the decode graph does). After a batch with
    penalties and greedy lanes mixed, every lane's counts are the histogram of its own generated tokens."""
    from ninfer.runtime.engine import SamplingParams
    _, art = models("dense")
    eng = Engine(art, backend="reference", max_context=128, max_seqs=4)
    params = [SamplingParams(temperature=0.9, presence_penalty=1.0, seed=3), SamplingParams(),
              SamplingParams(temperature=0.8, frequency_penalty=0.7, seed=4)]
    seqs = [eng.open(prompt(6 + i, 20 + i), max_new=12, sampling=sp) for i, sp in enumerate(params)]
    try:
        for seq in seqs:
            while not eng.prefill(seq):
                pass
        while live := [s for s in seqs if s.finish_reason is None]:
            eng.decode(live)
        for seq in seqs:
            want = torch.bincount(torch.tensor(seq.generated), minlength=eng._counts.shape[1]).to(torch.int32)
            assert torch.equal(eng._counts[seq.slot], want), f"lane {seq.slot}"
        assert int(eng._counts.sum()) == sum(len(s.generated) for s in seqs) == 36
    finally:
        for seq in seqs:
            eng.release(seq)
    assert eng.cache.in_use == (0, 0)
