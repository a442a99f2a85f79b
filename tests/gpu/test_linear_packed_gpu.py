"""The decode/verify GEMV over packed weights (linear_{q4,q5,q6,w8,fp8}, routes gemv and gemv_*) on the GPU.

Weights come from the real codec (ninfer.runtime.formats.encode of random normal * 0.05 fp32 matrices),
x is random bf16; every gemv tile runs at every T it admits on odd and even shapes (short last 128-row
tile, K not a multiple of 128, K = 8), and is compared with the reference backend (exact decode, fp32
matmul, one bf16 rounding) on clones under the op's preset. The buffers around the arguments are poisoned
(NaN after x's last row and in its absent token rows, 0xFF bytes after w: NaN scales / E4M3 NaN codes,
a sentinel after y) so a read past K, past T or past the packed bytes, or a write past y, shows up.
Plus: linear_swiglu_q4's GEMV routes (SwiGLU in the epilogue), the route table at T = 1, 8, 9 and its last GEMV
span's end, two real 27B shapes, and a CUDA-graph capture of a gemv call. Skips cleanly without a GPU."""
import numpy as np
import pytest
import torch

from ninfer.runtime.decode_graph import capture
from ninfer.runtime.dispatch import ReferenceBackend
from ninfer.runtime.formats import encode
from ninfer.runtime.manifest import evaluate
from ninfer.runtime.tolerance import compare
from tests.gpu.graphs import replay_then_eager

pytestmark = pytest.mark.gpu

FORMATS = ["q4", "q5", "q6", "w8", "fp8"]
NS = [1, 77, 128, 130, 300]
KS = [8, 72, 128, 200, 5120]
# Long rows whose K is not a multiple of 128: q4 K = 1032 is 9 units of 128 lanes, 2120 is 17 (8-bit formats
# twice that), so the unrolled main loop ends with a partial step.
STAGED = [(77, 1032), (130, 2120)]


@pytest.fixture(scope="module")
def be():
    from ninfer.runtime.dispatch import CudaBackend
    torch.backends.cuda.matmul.allow_tf32 = False
    return CudaBackend()


@pytest.fixture(scope="module")
def ref(be):
    return ReferenceBackend(be.manifest)


def is_gemv(route):
    """A decode route: gemv or one of its variants (gemv_fma, ...)."""
    return route == "gemv" or route.startswith("gemv_")


def gemv_tiles(be, fmt, N, K):
    """(instance, tmax) of every tile of every gemv route (gemv, gemv_fma, ...) built for this GPU's arch whose
    constraints admit the shape (at T = 1; tmax bounds T)."""
    kernels = [k for k in be.manifest.kernels.values()
               if k.arch == be.device.arch and k.op == f"linear_{fmt}" and is_gemv(k.route) and k.dtype == "bf16"]
    assert kernels, f"no gemv tiles for linear_{fmt} on {be.device.arch}"
    dims = {"T": 1, "N": N, "K": K}
    return sorted((k.instance, k.data["tile_params"]["tmax"]) for k in kernels
                  if all(evaluate(c, dims) for c in k.constraints))


_WEIGHTS = {}


def packed(fmt, n, k, seed=0):
    """(bytes on the GPU inside a 0xFF-poisoned buffer, the fp32 source) for a random [n, k] matrix."""
    key = (fmt, n, k, seed)
    if key not in _WEIGHTS:
        rng = np.random.default_rng(1000 * seed + 7 * n + k)
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        wb = encode(fmt, w)
        buf = torch.full((wb.size + 4096,), 0xFF, dtype=torch.uint8)
        buf[:wb.size] = torch.from_numpy(wb)
        _WEIGHTS[key] = buf.cuda()[:wb.size]
    return _WEIGHTS[key]


def activations(T, k, tmax, seed):
    """x [T, k] bf16, followed in memory by NaN rows up to tmax and a NaN tail."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((max(T, tmax) * k + 256,), float("nan"), dtype=torch.bfloat16)
    buf[:T * k] = torch.randn(T * k, generator=g).bfloat16()
    return buf.cuda()[:T * k].view(T, k)


def output(T, n):
    """y [T, n] poisoned with NaN, followed by a sentinel region."""
    buf = torch.full((T * n + 64,), float("nan"), dtype=torch.bfloat16, device="cuda")
    buf[T * n:] = 12.5
    return buf, buf[:T * n].view(T, n)


def run_and_check(be, ref, fmt, w, x, N, route=None):
    """Run linear_{fmt} (a named route, or the table's), compare with the reference backend; return the
    kernel instance used. Besides the preset (a norm test), a gemv result must be within one bf16 ulp of
    the reference plus 1e-4 of its largest value, element by element: both sides accumulate exact
    products in fp32 (the xs tiles of x rounded to 16-bit block fixed point, within 2^-14 of each 64-lane
    group's largest |x|), so anything more is a layout bug that a norm could hide."""
    return check_op(be, ref, f"linear_{fmt}", w, x, N, route, slack=1e-4)


def check_op(be, ref, op, w, x, n, route, slack):
    """Run op (x, w -> y [T, n]) on a route or the table's, against the reference: nothing written past y, the op's
    preset, and for a gemv route each element within one bf16 ulp plus `slack` of the largest |value|."""
    T = x.shape[0]
    ybuf, y = output(T, n)
    plan = be.plan(op, route=route, x=x, w=w, y=y)
    plan()
    torch.cuda.synchronize()
    y_ref = torch.empty(T, n, dtype=torch.bfloat16, device="cuda")
    ref.run(op, x=x.clone(), w=w.clone(), y=y_ref)
    torch.cuda.synchronize()
    where = f"{op} n={n} K={x.shape[1]} T={T} via {plan.kernel.instance}"
    assert torch.all(ybuf[T * n:] == 12.5), f"{where}: wrote past y"
    v = compare(y, y_ref, be.manifest.tolerances[be.contract(op)["tolerance"]], where)
    assert v, v.detail
    if is_gemv(plan.kernel.route):
        d, r = (y.double() - y_ref.double()).abs(), y_ref.double().abs()
        bound = r * 2.0 ** -7 + slack * r.max() + 1e-30
        assert torch.all(d <= bound), f"{where}: max |d| / bound = {(d / bound).max().item():.2f} ({v.detail})"
    return plan.kernel.instance


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("N,K", [(n, k) for n in NS for k in KS] + STAGED, ids=lambda v: str(v))
def test_every_gemv_tile(be, ref, fmt, N, K):
    w = packed(fmt, N, K)
    for route, tmax in gemv_tiles(be, fmt, N, K):
        for T in range(1, tmax + 1):
            x = activations(T, K, tmax, seed=31 * T + K + N)
            assert run_and_check(be, ref, fmt, w, x, N, route=route) == route


@pytest.mark.parametrize("I,K", [(8, 8), (77, 200), (128, 512), (136, 1032), (200, 5120)], ids=str)
def test_every_swiglu_gemv_tile(be, ref, I, K):
    """linear_swiglu_q4's GEMV routes (a gate row and its up row as mma rows g / g + 8, silu(g) * u in the epilogue)
    at every T each admits, on the [2I, K] packed matrix, against the reference under the op's preset; element by
    element within one bf16 ulp plus 1e-3 of the largest value (two fp32 sums multiplied, then one rounding)."""
    op = "linear_swiglu_q4"
    kernels = [k for k in be.manifest.kernels.values()
               if k.arch == be.device.arch and k.op == op and is_gemv(k.route) and k.dtype == "bf16"]
    assert kernels, f"no gemv tiles for {op} on {be.device.arch}"
    tiles = sorted((k.instance, k.data["tile_params"]["tmax"]) for k in kernels
                   if all(evaluate(c, {"T": 1, "I": I, "K": K}) for c in k.constraints))
    w = packed("q4", 2 * I, K)
    for route, tmax in tiles:
        for T in range(1, tmax + 1):
            x = activations(T, K, tmax, seed=17 * T + K + I)
            check_op(be, ref, op, w, x, I, route, slack=1e-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_route_table_boundary(be, ref, fmt):
    """No route named: the table's choice at T = 1, 8, 9 and at both sides of the last gemv span's end
    (the hand-over to the mma route: T = 65 for q4, whose default table takes the token-chunked GEMV up to 64;
    T = 17 or 9 for the others), on an odd shape."""
    N, K = 300, 200
    op = f"linear_{fmt}"
    spans = be.manifest.table(be.device.arch, op, "bf16", {"N": N, "K": K})
    last = max(hi for lo, hi, use in spans if is_gemv(use.split(".")[0]) and hi is not None)
    w = packed(fmt, N, K)
    for T in sorted({1, 8, 9, last, last + 1}):
        used = run_and_check(be, ref, fmt, w, activations(T, K, T, seed=T), N)
        assert used == be.manifest.resolve(be.device.arch, op, "bf16", {"N": N, "K": K}, T).instance
        assert is_gemv(used.split(".")[0]) == (T <= last), (T, used)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("N,K", [(17408, 5120), (5120, 17408), (10637, 1024)], ids=lambda v: str(v))
def test_real_shape(be, ref, fmt, N, K):
    """gate/up (17408 x 5120) and down (5120 x 17408) projections of the 27B model at T = 1 and 4, the
    table's choice and every gemv tile that admits T; and 10637 x 1024: more 16-row tiles than a persistent
    gemv's grid of 5 blocks per SM on 132 SMs, with a short last tile."""
    w = packed(fmt, N, K)
    for T in (1, 4):
        x = activations(T, K, T, seed=T)
        run_and_check(be, ref, fmt, w, x, N)
        for route, tmax in gemv_tiles(be, fmt, N, K):
            if T <= tmax:
                run_and_check(be, ref, fmt, w, x, N, route=route)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_capture(be, ref, fmt):
    """A gemv plan (the table's) captured once and replayed twice gives the eager result, bit for bit, on
    new inputs."""
    check_graph_capture(be, ref, fmt, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_capture_every_gemv_tile(be, ref, fmt):
    """The same for every gemv tile."""
    for route, _ in gemv_tiles(be, fmt, 300, 5120):
        check_graph_capture(be, ref, fmt, route)


def check_graph_capture(be, ref, fmt, route):
    N, K, T = 300, 5120, 1
    w = packed(fmt, N, K)
    x = activations(T, K, T, seed=5)
    y = torch.empty(T, N, dtype=torch.bfloat16, device="cuda")
    plan = be.plan(f"linear_{fmt}", route=route, x=x, w=w, y=y)
    assert is_gemv(plan.kernel.route)
    if route is not None:
        assert plan.kernel.instance == route
    graph = capture(plan)
    outs = []
    for trial in range(2):
        x.copy_(torch.randn(T, K, generator=torch.Generator().manual_seed(100 + trial)).bfloat16())
        y.fill_(float("nan"))
        replayed, = replay_then_eager(graph, plan, y)
        assert torch.equal(replayed, y), f"replay {trial} differs from eager"
        y_ref = torch.empty_like(y)
        ref.run(f"linear_{fmt}", x=x.clone(), w=w.clone(), y=y_ref)
        v = compare(replayed, y_ref, be.manifest.tolerances["linear_tc"], f"{plan.kernel.instance} graph replay {trial}")
        assert v, v.detail
        outs.append(replayed)
    assert not torch.equal(outs[0], outs[1])  # the replays saw the new inputs


@pytest.mark.parametrize("fmt", ["q4", "q5", "q6"])
def test_xs_tiles_with_outliers(be, ref, fmt):
    """The xs tiles (and gemv_batch_s8) round x to 16-bit block fixed point per 64-lane group, so one large lane
    coarsens its group (activation outliers, as after an RMSNorm of a residual with massive activations): every
    group of x gets one lane 300x the others, and the result must still meet the op's preset."""
    N, K = 300, 5120
    w = packed(fmt, N, K)
    xs = {k.instance for k in be.manifest.kernels.values()
          if k.op == f"linear_{fmt}" and (k.data["tile_params"].get("xs") or "_s8" in k.route)}
    tiles = [(r, tmax) for r, tmax in gemv_tiles(be, fmt, N, K) if r in xs]
    assert tiles, "no xs tiles admit the shape"
    for route, tmax in tiles:
        for T in range(1, tmax + 1):
            x = activations(T, K, tmax, seed=7 * T)
            x.view(T, K // 64, 64)[:, :, 5] *= 300.0
            ybuf, y = output(T, N)
            be.plan(f"linear_{fmt}", route=route, x=x, w=w, y=y)()
            y_ref = torch.empty(T, N, dtype=torch.bfloat16, device="cuda")
            ref.run(f"linear_{fmt}", x=x.clone(), w=w.clone(), y=y_ref)
            torch.cuda.synchronize()
            v = compare(y, y_ref, be.manifest.tolerances["linear_tc"], f"{route} T={T} with outliers")
            assert v, v.detail


def test_workspace_is_per_stream(be, ref):
    """gemv_batch_s8's pre kernel writes x into the backend's workspace; plans made beside() the main stream's (the
    MoE shared expert's fork) get another one: the same route run on two streams at once gives each its own result."""
    N, K, T, route = 300, 5120, 8, "gemv_batch_s8.t8m2s4u1"
    w = packed("q4", N, K)
    side = torch.cuda.Stream()
    xs = [activations(T, K, T, seed=s) for s in (1, 2)]
    ys = [torch.empty(T, N, dtype=torch.bfloat16, device="cuda") for _ in xs]
    main_plan = be.plan("linear_q4", route=route, x=xs[0], w=w, y=ys[0])
    with torch.cuda.stream(side), be.beside():
        side_plan = be.plan("linear_q4", route=route, x=xs[1], w=w, y=ys[1])
    assert main_plan.workspace.data_ptr() != side_plan.workspace.data_ptr()
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(20):   # overlapping launches: a shared workspace would mix the two x
        main_plan()
        with torch.cuda.stream(side):
            side_plan()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for x, y in zip(xs, ys):
        y_ref = torch.empty_like(y)
        ref.run("linear_q4", x=x.clone(), w=w.clone(), y=y_ref)
        v = compare(y, y_ref, be.manifest.tolerances["linear_tc"], f"{route} on two streams")
        assert v, v.detail
