"""A model whose linear and expert weights stay packed (q4/q5/q6/w8/fp8 ops, reference backend) computes
what the same artifact computes with every weight decoded up front: the packed path is the decoded math."""
import pytest
import torch

from ninfer.runtime.convert import convert, plan_conversion
from ninfer.runtime.engine import Engine
from ninfer.runtime.reference_quant import unpack
from ninfer.runtime.weights import PackedWeight
from tests.fixtures.tiny_checkpoints import build


def decoded(weights: dict) -> dict:
    out = {}
    for name, w in weights.items():
        if isinstance(w, PackedWeight):
            n, k = w.matrix
            w = unpack(w.fmt, w.data, n, k).reshape(w.shape)
        out[name] = w
    return out


@pytest.mark.parametrize("kind,fmt", [("dense", None), ("dense", "w8"), ("dense", "fp8"), ("moe", None),
                                      ("moe", "q6"), ("next", None)])
def test_packed_equals_decoded(tmp_path, kind, fmt):
    d = build(kind, tmp_path / "ckpt")
    art = tmp_path / f"{kind}.ninfer"
    plan = plan_conversion(d, fmt=fmt)   # None: the recipe's mix (q4 / q5 / q6 by role)
    convert(plan, art)
    plan.checkpoint.close()
    eng = Engine(art, backend="reference", max_context=64, packed_weights=True)
    try:
        packed = [n for n, w in eng.weights.items() if isinstance(w, PackedWeight)]
        assert any(".experts." in n for n in packed) == (kind != "dense") and "lm_head" in packed
        ref = Engine.from_weights(eng.cfg, decoded(eng.weights), backend="reference", max_context=64)
        ids = list(range(3, 40, 2))
        assert torch.allclose(eng.score(ids), ref.score(ids), rtol=1e-4, atol=1e-5)
        assert eng.generate([ids[:7]], max_new=8)[0].generated == ref.generate([ids[:7]], max_new=8)[0].generated
    finally:
        eng.close()


def test_the_reference_backend_decodes_packed_weights_at_load_by_default(tmp_path):
    d = build("dense", tmp_path / "ckpt")
    plan = plan_conversion(d, fmt="q4")
    convert(plan, tmp_path / "q4.ninfer")
    plan.checkpoint.close()
    eng = Engine(tmp_path / "q4.ninfer", backend="reference", max_context=64)
    try:
        assert not any(isinstance(w, PackedWeight) for w in eng.weights.values())
    finally:
        eng.close()


def moe_engine(tmp_path, fmt):
    """The tiny MoE checkpoint converted with fmt (None: the recipe's mix) on the reference backend, weights packed."""
    d = build("moe", tmp_path / "ckpt")
    art = tmp_path / "moe.ninfer"
    plan = plan_conversion(d, fmt=fmt)
    convert(plan, art)
    plan.checkpoint.close()
    return Engine(art, backend="reference", max_context=64, packed_weights=True)


def record_ops(monkeypatch, eng) -> list:
    """The names of the ops the engine's backend runs from here on, in order."""
    calls = []
    run = eng.be.run
    monkeypatch.setattr(eng.be, "run", lambda op, **kw: (calls.append(op), run(op, **kw))[1])
    return calls


# (MOE_SPLIT_MAX_T, MOE_GROUPED_MIN_T) -> the expert ops every step runs (the prompt and each decode step)
MOE_FORMS = {"split": ((64, None), ("moe_gate_up_", "moe_down_")),
             "grouped": ((0, 1), ("moe_align", "moe_gate_up_grouped_", "moe_down_grouped_", "moe_sum"))}


@pytest.mark.parametrize("form", sorted(MOE_FORMS))
@pytest.mark.parametrize("fmt", [None, "q6"])
def test_the_split_and_grouped_moe_forms_compute_the_single_op(tmp_path, monkeypatch, fmt, form):
    """The decode form (moe_gate_up_<fmt> + moe_down_<fmt>) and the prefill form (moe_align, the grouped ops,
    moe_sum) of the packed experts give the logits and greedy tokens of the single op moe_experts_<fmt>."""
    from ninfer.runtime.models import blocks
    eng = moe_engine(tmp_path, fmt)
    try:
        ids = list(range(3, 40, 2))
        calls = record_ops(monkeypatch, eng)
        monkeypatch.setattr(blocks, "MOE_SPLIT_MAX_T", 0)
        monkeypatch.setattr(blocks, "MOE_GROUPED_MIN_T", None)
        single_logits = eng.score(ids)
        single = eng.generate([ids[:7]], max_new=8)[0].generated
        assert any(op.startswith("moe_experts_") for op in calls)
        (split_max, grouped_min), prefixes = MOE_FORMS[form]
        monkeypatch.setattr(blocks, "MOE_SPLIT_MAX_T", split_max)
        monkeypatch.setattr(blocks, "MOE_GROUPED_MIN_T", grouped_min)
        calls.clear()
        assert torch.allclose(eng.score(ids), single_logits, rtol=1e-4, atol=1e-5)
        assert eng.generate([ids[:7]], max_new=8)[0].generated == single
        expert_ops = {op for op in calls if op.startswith("moe_") and op not in ("moe_router", "moe_topk")}
        assert {p for p in prefixes if any(op.startswith(p) for op in expert_ops)} == set(prefixes)
        assert not any(op.startswith("moe_experts") for op in expert_ops)
    finally:
        eng.close()
