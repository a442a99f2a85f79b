"""Every route of every op against its fp64 reference on the GPU, at every span boundary of the route
tables (T = 1, b-1, b, b+1, an interior point), with the op's named tolerance; plus CUDA-graph capture.
Skips cleanly without a GPU (cuInit raises there)."""
import pytest
import torch

from ninfer.runtime.contracts import ContractError
from ninfer.runtime.decode_graph import capture
from ninfer.runtime.dispatch import ReferenceBackend
from ninfer.runtime.manifest import RouteError, evaluate
from ninfer.runtime.tolerance import compare
from tests.gpu.graphs import replay_then_eager
from tests.ops_cases import PROBLEMS, boundary_ts, gpu_kernels, make_inputs, oracle

pytestmark = pytest.mark.gpu
ROUTE_TS = [1, 2, 3, 7, 8, 9, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000]


def check(be, op, dims, route=None, seed=0):
    contract = be.contract(op)
    gen = torch.Generator().manual_seed(seed)
    ts = make_inputs(contract, dims, "cuda", gen)
    params = {k: v["default"] for k, v in contract["params"].items()}
    plan = be.plan(op, route=route, **ts, **params)
    plan()
    torch.cuda.synchronize()
    ref = oracle(op, contract, ts, params)
    preset = be.manifest.tolerances[contract["tolerance"]]
    for name in contract["outputs"]:
        v = compare(ts[name], ref[name], preset, f"{op} {dims} via {plan.kernel.instance}")
        assert v, v.detail
    return plan.kernel.instance


def table_cases():
    from ninfer.runtime.cuda import device, gpu_available
    from ninfer.runtime.manifest import Manifest
    if not gpu_available():
        return []
    m, arch = Manifest.load(), device().arch
    cases = []
    for op, problems in sorted(PROBLEMS.items()):
        for problem in problems:
            for T in boundary_ts(m.table(arch, op, "bf16", problem)):
                cases.append((op, {"T": T, **problem}))
    return cases


def route_cases():
    cases = []
    for k in gpu_kernels(PROBLEMS):
        for i, problem in enumerate(PROBLEMS[k.op]):  # the first problem at every T, the others at a few
            for T in ROUTE_TS if i == 0 else ROUTE_TS[::6]:
                if all(evaluate(c, {"T": T, **problem}) for c in k.constraints):
                    cases.append((k.op, k.instance, {"T": T, **problem}))
    return cases


@pytest.mark.parametrize("op,dims", table_cases(), ids=lambda v: str(v))
def test_table_routes_at_span_boundaries(be, op, dims):
    check(be, op, dims, seed=dims["T"])


@pytest.mark.parametrize("op,route,dims", route_cases(), ids=lambda v: str(v))
def test_every_route(be, op, route, dims):
    assert check(be, op, dims, route=route, seed=7 * dims["T"] + 1) == route


def test_linear_large_prefill_shape(be):
    for T in (2048, 4096):
        check(be, "linear", {"T": T, "N": 17408, "K": 5120}, seed=T)


def test_bad_calls_on_gpu(be):
    x = torch.randn(4, 12, device="cuda").bfloat16()
    w = torch.randn(12, device="cuda").bfloat16()
    with pytest.raises(RouteError, match=r"rms_norm: route row\.t256 \(sm_\w+\) requires H % 8 == 0, which fails for T=4, H=12"):
        be.plan("rms_norm", x=x, w=w, y=torch.empty_like(x))
    with pytest.raises(ContractError, match="argument w is on cpu, the others on cuda"):
        be.plan("rms_norm", x=x, w=w.cpu(), y=torch.empty_like(x))
    x8 = torch.randn(4, 16, device="cuda").bfloat16()
    with pytest.raises(ContractError, match="linear: argument w has dtype torch.float16, expected torch.bfloat16"):
        be.plan("linear", x=x8, w=torch.randn(8, 16, device="cuda").half(), y=torch.empty(4, 8, device="cuda").bfloat16())


def test_cuda_graph_capture_and_replay(be):
    """A decoder-MLP-shaped chain of plans captured once and replayed on new inputs: same results as eager."""
    T, H, I, V = 5, 512, 1024, 4096
    g = torch.Generator(device="cuda").manual_seed(3)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    ids = torch.randint(0, V, (T,), device="cuda", dtype=torch.int32, generator=g)
    table, wn, wgu, wd = r(V, H), r(H) * 0.1, r(2 * I, H) * 0.05, r(H, I) * 0.05
    h, xn, gu, act, out = (torch.empty(T, n, device="cuda").bfloat16() for n in (H, H, 2 * I, I, H))
    plans = [be.plan("embedding", ids=ids, table=table, y=h),
             be.plan("rms_norm_zc", x=h, w=wn, y=xn),
             be.plan("linear", x=xn, w=wgu, y=gu),
             be.plan("silu_and_mul", x=gu, y=act),
             be.plan("linear", x=act, w=wd, y=out),
             be.plan("add", a=h, b=out, y=h)]

    def step():
        for p in plans:
            p()

    warm = torch.cuda.CUDAGraph()  # torch's own one-time capture state (RNG offsets) is allocated here
    with torch.cuda.graph(warm):
        pass
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        step()
    assert torch.cuda.memory_allocated() == before  # the launch path allocates nothing

    graph = capture(step)
    assert torch.cuda.memory_allocated() == before  # the launch path allocates nothing
    for trial in range(3):
        ids.copy_(torch.randint(0, V, (T,), device="cuda", dtype=torch.int32, generator=g))
        replayed, = replay_then_eager(graph, step, h)
        assert torch.equal(replayed, h), f"replay {trial} differs from eager"
        # The same chain on the reference backend (fp32 math, bf16 buffers at the same points).
        ref_h, ref_xn, ref_gu, ref_act, ref_out = (torch.empty_like(t) for t in (h, xn, gu, act, out))
        ref = ReferenceBackend(be.manifest)
        ref.run("embedding", ids=ids, table=table, y=ref_h)
        ref.run("rms_norm_zc", x=ref_h, w=wn, y=ref_xn)
        ref.run("linear", x=ref_xn, w=wgu, y=ref_gu)
        ref.run("silu_and_mul", x=ref_gu, y=ref_act)
        ref.run("linear", x=ref_act, w=wd, y=ref_out)
        ref.run("add", a=ref_h, b=ref_out, y=ref_h)
        v = compare(h, ref_h, be.manifest.tolerances["linear_tc"], f"graph replay {trial}")
        assert v, v.detail


def test_plan_cache_reuses_identical_calls_and_still_checks(be):
    """A repeated call returns the cached launch; any change in a tensor (address, shape, strides) or a scalar
    makes a new plan, so a non-contiguous view over a cached buffer is still refused."""
    from ninfer.runtime.contracts import ContractError
    big = torch.randn(4, 512, device="cuda").bfloat16()
    x = big.view(-1)[:1024].view(4, 256)          # contiguous, at big's address, shape [4, 256]
    w, y = torch.randn(256, device="cuda").bfloat16(), torch.empty(4, 256, device="cuda").bfloat16()
    p1 = be.plan("rms_norm_zc", x=x, w=w, y=y, eps=1e-6)
    assert be.plan("rms_norm_zc", x=x, w=w, y=y, eps=1e-6) is p1
    assert be.plan("rms_norm_zc", x=x, w=w, y=y, eps=1e-5) is not p1
    with pytest.raises(ContractError, match="contiguous"):   # same address and shape as x, other strides
        be.plan("rms_norm_zc", x=big[:, :256], w=w, y=y, eps=1e-6)
