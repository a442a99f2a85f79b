"""This GPU's tuned route tables (specs/tuned/, ninfer-tune) at every span boundary: the table path (no
route named) against the reference on clones, for every tuned linear problem small enough to check."""
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
            if op.startswith("linear") and e["problem"] and e["problem"]["N"] * e["problem"]["K"] <= MAX_WEIGHTS:
                cases += [(op, e["problem"], T) for T in boundary_ts(e["spans"])]
    return cases


@pytest.mark.parametrize("op,problem,T", tuned_cases())
def test_tuned_span_boundaries(be, ref, op, problem, T):
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
