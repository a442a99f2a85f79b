"""This GPU's tuned route tables (specs/tuned/, ninfer-tune) at every span boundary: the table path (no
route named) against the reference on clones, with the op's tolerance, for every tuned linear problem small
enough to check and every other tuned problem (experts, norms, router, GDN decode, attention) on ninfer-tune's
own inputs."""
import pytest
import torch

from ninfer.runtime.tolerance import compare
from tests.ops_cases import boundary_ts

pytestmark = pytest.mark.gpu
MAX_WEIGHTS = 128 << 20    # elements: the fp32 reference of the 248320-row lm_head would take 5 GB


def tuned_cases():
    from ninfer.runtime.cuda import device, gpu_available
    from ninfer.runtime.manifest import Manifest
    if not gpu_available():
        return []
    dev, m = device(), Manifest.load()
    cases = []
    for op, by_dtype in sorted(m.tuned_for(dev.name, dev.arch).items()):
        for e in by_dtype.get("bf16", []):
            if not e["problem"]:
                continue
            rows = e["problem"].get("N", 2 * e["problem"].get("I", 0))   # linear_swiglu_*: the [gate | up] rows
            if op.startswith("linear") and rows * e["problem"]["K"] > MAX_WEIGHTS:
                continue
            cases += [(op, e["problem"], T) for T in boundary_ts(e["spans"])]
    return cases


@pytest.mark.parametrize("op,problem,T", tuned_cases())
def test_tuned_span_boundaries(be, ref, op, problem, T):
    if not op.startswith("linear") or "N" not in problem:   # linear_swiglu_* too: ninfer-tune's inputs
        return check_other_op(be, ref, op, problem, T)
    from ninfer.runtime.weights import random_packed
    g = torch.Generator(device="cuda").manual_seed(T)
    n, k = problem["N"], problem["K"]
    x = (torch.randn(T, k, device="cuda", generator=g)).bfloat16()
    if op == "linear":
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    else:
        w = random_packed(op.split("_", 1)[1], (n, k), "cuda", g, k ** -0.5).data
    y, want = torch.empty(T, n, device="cuda").bfloat16(), torch.empty(T, n, device="cuda").bfloat16()
    plan = be.plan(op, x=x, w=w, y=y)
    plan()
    ref.run(op, x=x.clone(), w=w.clone(), y=want)
    v = compare(y, want, be.manifest.tolerances["linear_tc"], f"{op} {problem} T={T} via {plan.kernel.instance}")
    assert v, v.detail


def check_other_op(be, ref, op, problem, T):
    """A tuned non-linear problem on the inputs ninfer-tune times it on (cli/bench_inputs.py; the flash-decoding
    ops at the split count the model uses, cli/tune.py step_dims)."""
    from ninfer.cli.bench_inputs import make_inputs
    from ninfer.cli.tune import step_dims, step_params
    contract = be.contract(op)
    g = torch.Generator(device="cuda").manual_seed(T)
    tuned = [(o, p) for o, p, _ in tuned_cases()]
    dims = {"T": T, **problem, **step_dims(op, T, problem, tuned)}
    ins = make_inputs(torch, contract, "bf16", dims, g, op)
    params = step_params(contract, op, dims)
    outs = [k for k in contract["outputs"]]
    plan = be.plan(op, **ins, **params)
    want = {k: torch.empty_like(ins[k]) for k in outs}
    ref.run(op, **{k: want[k] if k in want else v.clone() for k, v in ins.items()}, **params)
    plan()
    torch.cuda.synchronize()
    preset = be.manifest.tolerances[contract["tolerance"]]
    for k in outs:
        v = compare(ins[k], want[k], preset, f"{op} {problem} T={T} {k} via {plan.kernel.instance}")
        assert v, v.detail
