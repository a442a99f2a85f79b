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


@pytest.mark.parametrize("kind", KINDS)
def test_logits_within_bf16_tolerance(engines, kind):
    eng = engines(kind)
    preset = eng.be.manifest.tolerances["model_bf16"]
    for case in cases(kind)[:4]:
        ids = case["prompt"] + case["greedy"]
        got = eng.score(ids)
        v = compare(got.float(), case["logits"].float(), preset, f"{kind} n={len(case['prompt'])}")
        assert v, v.detail
    assert eng.cache.in_use == (0, 0)


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
    eng = engines(kind)
    prompts = [c["prompt"] for c in cases(kind)]
    batched = [s.generated for s in eng.generate(prompts, max_new=16)]
    alone = [eng.generate([p], max_new=16)[0].generated for p in prompts]
    assert batched == alone
    assert eng.cache.in_use == (0, 0)


def test_reference_backend_agrees(engines):
    from ninfer.runtime.engine import Engine
    eng = engines("dense")
    ref = Engine(ORACLE / "dense.ninfer", backend="reference", max_context=128)
    preset = eng.be.manifest.tolerances["model_bf16"]
    ids = cases("dense")[2]["prompt"]
    v = compare(eng.score(ids).float().cpu(), ref.score(ids), preset, "cuda vs reference")
    assert v, v.detail
