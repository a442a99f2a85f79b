"""GPU tests of the token-selection kernels (argmax, sample) against their references.

The oracle is the same op run by ReferenceBackend on cloned GPU tensors (the references compute in fp64).
Both contracts are `exact`: the kernel must return the reference's ids. The kernels and their exactness
limits are described in codegen/templates/sampling.cu.j2. In short, the sample kernel decides in fp64
exactly as the reference, except for two approximations: the fp32 tail of the softmax denominator (ids
outside the first window of at most `cap` candidates) and, when more than `cap` ids are kept, fp32 bin
masses that locate the window of the draw. The cases below are chosen so that those approximations are
exercised yet far from any decision boundary. Skips cleanly without a GPU (cuInit raises there).
"""
import math

import pytest
import torch

from ninfer.runtime.tolerance import compare

pytestmark = pytest.mark.gpu

V_SMALL = 1024
V_REAL, D_REAL = 248320, 248077  # Qwen3.5/3.6 vocabulary rows and token domain
POISON = -12345
TABLE_TS = [1, 2, 8, 39]  # the tables are one span 1..inf: T=1 and an interior point, plus small batches

# temperature, top_k, top_p, min_p, presence, frequency
GRID = [
    (1.0, 0, 1.0, 0.0, 0.0, 0.0),      # pure temperature sampling (every id kept)
    (0.7, 20, 0.95, 0.0, 0.0, 0.0),    # Qwen-style defaults
    (0.6, 20, 0.95, 0.0, 1.5, 0.0),    # + presence penalty
    (1.3, 0, 0.9, 0.0, 0.0, 0.0),      # top-p only
    (0.5, 50, 1.0, 0.1, 0.0, 0.0),     # top-k + min-p
    (1.0, 0, 1.0, 0.05, 0.5, 0.1),     # min-p + both penalties
    (2.0, 5, 0.5, 0.0, 0.0, 0.0),
    (0.9, 0, 0.99, 0.0, 0.0, 0.3),     # frequency penalty
    (1.0, 1, 1.0, 0.0, 0.0, 0.0),      # top-1 through the sampling path
    (1.0, 100000, 1.0, 0.0, 0.0, 0.0),  # top-k beyond the domain
    (1.0, 0, 0.0, 0.0, 0.0, 0.0),      # top-p 0 keeps one id
    (0.8, 0, 1.0, 1.0, 0.0, 0.0),      # min-p 1 keeps the max only
    (0.05, 0, 1.0, 0.0, 0.0, 0.0),     # cold
    (10.0, 0, 0.8, 0.0, 0.0, 0.0),     # hot
    (1.0, 40, 0.8, 0.02, -0.5, -0.1),  # negative penalties (boosts)
    (0.0, 0, 1.0, 0.0, 0.7, 0.2),      # greedy with penalties
    (-1.0, 7, 0.5, 0.3, 0.0, 0.0),     # negative temperature: greedy, the other knobs ignored
]


def distinct_logits(T, V, gen, scale=2.0):
    """T rows of V pairwise distinct bf16 values drawn from N(0, scale^2)."""
    rows = []
    for _ in range(T):
        pool = torch.unique((torch.randn(8 * V + 4096, generator=gen) * scale).bfloat16().float())
        assert pool.numel() >= V
        rows.append(pool[torch.randperm(pool.numel(), generator=gen)[:V]])
    return torch.stack(rows).bfloat16()


def normal_logits(T, V, gen, scale=3.0):
    """Random bf16 logits (a real-sized vocabulary has ties: bf16 has fewer values than ids)."""
    return (torch.randn(T, V, generator=gen) * scale).bfloat16()


def sample_args(logits, settings, seeds, counters, gen, pen_frac=0.1):
    """Inputs of one sample call (CPU): one row per entry of `settings` (see GRID); rows with a penalty get
    counts in 1..7 on a random pen_frac of the ids, other rows all-zero counts."""
    T, V = logits.shape
    assert len(settings) == T
    counts = torch.zeros(T, V, dtype=torch.int32)
    for t, s in enumerate(settings):
        if s[4] or s[5]:
            m = torch.rand(V, generator=gen) < pen_frac
            counts[t, m] = torch.randint(1, 8, (int(m.sum()),), generator=gen, dtype=torch.int32)
    col = lambda i, dt: torch.tensor([s[i] for s in settings], dtype=dt)  # noqa: E731
    return dict(logits=logits, counts=counts, temperature=col(0, torch.float32), top_k=col(1, torch.int32),
                top_p=col(2, torch.float32), min_p=col(3, torch.float32), presence=col(4, torch.float32),
                frequency=col(5, torch.float32), seed=torch.tensor(seeds, dtype=torch.int32),
                counter=torch.tensor(counters, dtype=torch.int32))


def run_kernel(be, op, args, domain, route=None):
    dev = {k: v.cuda() for k, v in args.items()}
    ids = torch.full((dev["logits"].shape[0],), POISON, dtype=torch.int32, device="cuda")
    plan = be.plan(op, route=route, **dev, ids=ids, domain=domain)
    plan()
    torch.cuda.synchronize()
    return ids.cpu(), plan.kernel.instance


def run_ref(ref, op, args, domain):
    dev = {k: v.cuda().clone() for k, v in args.items()}
    ids = torch.full((dev["logits"].shape[0],), POISON, dtype=torch.int32, device="cuda")
    ref.plan(op, **dev, ids=ids, domain=domain)()
    torch.cuda.synchronize()
    return ids.cpu()


def check(be, ref, op, args, domain, what, route=None):
    """Kernel ids == reference ids (the `exact` preset), with the rows that differ in the message."""
    got, inst = run_kernel(be, op, args, domain, route)
    want = run_ref(ref, op, args, domain)
    v = compare(got, want, be.manifest.tolerances[be.contract(op)["tolerance"]], f"{op} {what} via {inst}")
    bad = (got != want).nonzero().flatten().tolist()
    detail = "; ".join(f"row {t}: kernel {got[t].item()} reference {want[t].item()}" for t in bad[:8])
    assert v and not bad, f"{v.detail}; {len(bad)} row(s) differ: {detail}"
    assert (got >= 0).all() and (got < domain).all()
    return got


# ---------------------------------------------------------------- argmax

@pytest.mark.parametrize("V,domain", [(V_SMALL, V_SMALL), (V_SMALL, 1000), (V_REAL, D_REAL), (V_REAL, V_REAL)])
@pytest.mark.parametrize("T", TABLE_TS)
def test_argmax_exact(be, ref, V, domain, T):
    gen = torch.Generator().manual_seed(V + domain + T)
    x = normal_logits(T, V, gen)
    x[:, domain:] = 100.0  # padded rows are never chosen
    check(be, ref, "argmax", {"logits": x}, domain, f"T={T} V={V} domain={domain}")


def test_argmax_ties_and_extremes(be, ref):
    gen = torch.Generator().manual_seed(1)
    x = ((torch.randn(6, V_REAL, generator=gen) * 4).round() / 4).bfloat16()  # heavy ties: the lowest id wins
    x[1, :] = 0.5                                       # a constant row: id 0
    x[2, : D_REAL - 3] = float("-inf")                  # only the last three ids are finite
    x[3, 777] = x[3, 123] = 1000.0                      # a tie between two maxima: 123
    x[4, :] = float("-inf")                             # all -inf: id 0 (torch.argmax)
    x[5, D_REAL - 1] = 3000.0                           # the last id of the domain
    got = check(be, ref, "argmax", {"logits": x}, D_REAL, "ties/extremes")
    assert got[1] == 0 and got[3] == 123 and got[4] == 0 and got[5] == D_REAL - 1


# ---------------------------------------------------------------- sample: exactness

@pytest.mark.parametrize("domain", [V_SMALL, 1000])
@pytest.mark.parametrize("rep", range(3))
def test_sample_grid_small_vocab(be, ref, domain, rep):
    """Every GRID setting (one row each, all in one batch), distinct logits, several seeds and counters."""
    gen = torch.Generator().manual_seed(100 * rep + domain)
    T = len(GRID)
    x = distinct_logits(T, V_SMALL, gen)
    args = sample_args(x, GRID, [1000 * rep + t for t in range(T)], [rep * 17 + 3 * t for t in range(T)], gen)
    check(be, ref, "sample", args, domain, f"grid rep={rep} V={V_SMALL} domain={domain}")


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_sample_grid_small_vocab_counters(be, ref, scale):
    """One row per (setting, counter): 6 counters for each GRID setting on the same logits."""
    gen = torch.Generator().manual_seed(int(scale * 10))
    base = distinct_logits(1, V_SMALL, gen, scale=scale)
    settings = [s for s in GRID for _ in range(6)]
    T = len(settings)
    args = sample_args(base.expand(T, -1).contiguous(), settings, [77] * T, [t % 6 for t in range(T)], gen)
    check(be, ref, "sample", args, V_SMALL, f"grid x counters scale={scale}")


@pytest.mark.parametrize("rep", range(2))
def test_sample_grid_real_vocab(be, ref, rep):
    """Every GRID setting on the real vocabulary (domain 248077 of 248320 rows)."""
    gen = torch.Generator().manual_seed(7 + rep)
    T = len(GRID)
    x = normal_logits(T, V_REAL, gen, scale=3.0)
    x[:, D_REAL:] = 100.0
    args = sample_args(x, GRID, [31 * rep + t for t in range(T)], [5 * rep + t for t in range(T)], gen)
    check(be, ref, "sample", args, D_REAL, f"grid rep={rep} V={V_REAL}")


HARD_CASES = ["flat", "ties", "masked", "hot", "near_ties", "big_k", "tiny_min_p", "top_p_999"]


@pytest.mark.parametrize("case", HARD_CASES)
def test_sample_real_vocab_hard_cases(be, ref, case):
    """Inputs that keep far more than one window of ids (the fallback), bins with thousands of ids (sub-bins,
    exact value groups), masked ids, near-tie penalised logits."""
    gen = torch.Generator().manual_seed(1000 + HARD_CASES.index(case))
    T = 4
    x = normal_logits(T, V_REAL, gen, scale=0.5)
    s = (1.0, 0, 1.0, 0.0, 0.0, 0.0)
    pen = 0.1
    if case == "ties":
        x = ((torch.randn(T, V_REAL, generator=gen) * 8).round() / 4).bfloat16()
        s = (1.0, 0, 0.9, 0.0, 0.0, 0.0)
    elif case == "masked":
        x = normal_logits(T, V_REAL, gen, scale=2.0)
        x[torch.rand(T, V_REAL, generator=gen) < 0.7] = float("-inf")
        s = (0.8, 0, 0.95, 0.0, 0.0, 0.0)
    elif case == "hot":
        x = normal_logits(T, V_REAL, gen, scale=3.0)
        s = (100.0, 0, 0.9, 0.0, 0.0, 0.0)
    elif case == "near_ties":  # logits on a 0.5 grid, frequency 0.1: penalised values within 1e-8 of others
        x = (torch.randint(-16, 16, (T, V_REAL), generator=gen).float() / 2).bfloat16()
        s = (1.0, 0, 1.0, 0.0, 0.0, 0.1)
        pen = 0.3
    elif case == "big_k":
        s = (1.0, 10000, 1.0, 0.0, 0.0, 0.0)
    elif case == "tiny_min_p":
        s = (1.0, 0, 1.0, 1e-6, 0.0, 0.0)
    elif case == "top_p_999":
        s = (1.0, 0, 0.999, 0.0, 0.0, 0.0)
    args = sample_args(x, [s] * T, [3 * t + 1 for t in range(T)], [t for t in range(T)], gen, pen_frac=pen)
    check(be, ref, "sample", args, D_REAL, f"{case} {s}")


def test_sample_domain_excludes_padding(be, ref):
    """Ids >= domain are never chosen, even with the largest logits of the row."""
    gen = torch.Generator().manual_seed(3)
    settings = [GRID[0], GRID[1], GRID[3], GRID[15], GRID[9]]
    T = len(settings)
    x = normal_logits(T, V_REAL, gen, scale=1.0)
    x[:, D_REAL:] = 1000.0
    args = sample_args(x, settings, list(range(T)), list(range(T)), gen)
    got = check(be, ref, "sample", args, D_REAL, "padding")
    assert (got < D_REAL).all()


def test_sample_greedy_equals_argmax(be, ref):
    """temperature <= 0 without penalties is exactly the argmax op; with penalties, the reference."""
    gen = torch.Generator().manual_seed(4)
    for V, domain in [(V_SMALL, 1000), (V_REAL, D_REAL)]:
        T = 8
        x = normal_logits(T, V, gen, scale=2.0)
        settings = [(0.0 if t % 2 else -0.5, 5, 0.5, 0.1, 0.0, 0.0) for t in range(T)]
        args = sample_args(x, settings, list(range(T)), list(range(T)), gen)
        got = check(be, ref, "sample", args, domain, f"greedy V={V}")
        am, _ = run_kernel(be, "argmax", {"logits": x}, domain)
        assert torch.equal(got, am)
        pen = sample_args(x, [(0.0, 0, 1.0, 0.0, 1.0, 0.25)] * T, list(range(T)), list(range(T)), gen, pen_frac=0.5)
        check(be, ref, "sample", pen, domain, f"greedy with penalties V={V}")


# ---------------------------------------------------------------- sample: determinism, independence, routes

def test_sample_deterministic_and_row_independent(be, ref):
    """Same inputs twice -> same ids; permuting the batch permutes the ids; each row alone gives the same id."""
    gen = torch.Generator().manual_seed(5)
    settings = [GRID[i] for i in (0, 1, 2, 3, 5, 7, 13, 14)]
    T = len(settings)
    for V, domain, scale in [(V_SMALL, V_SMALL, 2.0), (V_REAL, D_REAL, 3.0)]:
        x = normal_logits(T, V, gen, scale=scale)
        args = sample_args(x, settings, [11 * t for t in range(T)], [t * t for t in range(T)], gen)
        first, _ = run_kernel(be, "sample", args, domain)
        again, _ = run_kernel(be, "sample", args, domain)
        assert torch.equal(first, again)
        perm = torch.randperm(T, generator=gen)
        permuted, _ = run_kernel(be, "sample", {k: v[perm].contiguous() for k, v in args.items()}, domain)
        assert torch.equal(permuted, first[perm])
        for t in range(T):
            alone, _ = run_kernel(be, "sample", {k: v[t:t + 1].contiguous() for k, v in args.items()}, domain)
            assert alone.item() == first[t].item(), f"row {t} alone: {alone.item()} in the batch: {first[t].item()}"
        check(be, ref, "sample", args, domain, f"independence V={V}")


def route_instances(be, op):
    return sorted({k.instance for k in be.manifest.kernels.values() if k.op == op and k.arch == be.device.arch})


@pytest.mark.parametrize("op", ["argmax", "sample"])
def test_every_route_instance(be, ref, op):
    """Each built instance of the op, called by name, on T = 1, 2, 3, 7, 8, 9, 17 and both vocabularies."""
    insts = route_instances(be, op)
    assert insts
    gen = torch.Generator().manual_seed(6)
    for inst in insts:
        for T in (1, 2, 3, 7, 8, 9, 17):
            for V, domain in [(V_SMALL, 999), (V_REAL, D_REAL)]:
                x = normal_logits(T, V, gen, scale=3.0)
                if op == "argmax":
                    check(be, ref, op, {"logits": x}, domain, f"T={T} V={V}", route=inst)
                else:
                    settings = [GRID[(t * 5) % len(GRID)] for t in range(T)]
                    args = sample_args(x, settings, list(range(T)), [T + t for t in range(T)], gen)
                    check(be, ref, op, args, domain, f"T={T} V={V}", route=inst)


# ---------------------------------------------------------------- sample: distribution

def kept_probabilities(logits_row, temp, top_k, top_p, min_p, domain):
    """The reference's kept ids and their normalised probabilities (no penalties), fp64."""
    l = logits_row[:domain].double()
    p = torch.softmax(l / temp, 0)
    order = torch.sort(-p, stable=True).indices
    ps = p[order]
    keep = len(ps)
    if top_k > 0:
        keep = min(keep, top_k)
    if top_p < 1:
        keep = min(keep, max(int((torch.cumsum(ps[:keep], 0) < top_p).sum()) + 1, 1))
    if min_p > 0:
        keep = max(1, min(keep, int((ps[:keep] >= min_p * ps[0]).sum())))
    return order[:keep], ps[:keep] / ps[:keep].sum()


@pytest.mark.parametrize("V,domain,scale,setting", [
    (V_SMALL, V_SMALL, 1.5, (0.8, 50, 0.9, 0.0)),
    (V_SMALL, 1000, 1.0, (1.0, 0, 1.0, 0.0)),
    (V_REAL, D_REAL, 3.0, (0.7, 20, 0.95, 0.0)),
    (V_REAL, D_REAL, 2.0, (1.0, 0, 1.0, 0.0)),   # every id kept: the fallback draws
])
def test_sample_distribution(be, ref, V, domain, scale, setting):
    """One row repeated with counters 0..N-1: empirical frequencies vs the kept probabilities (chi-square),
    and exact agreement with the reference on a slice of the counters."""
    N = 4096
    gen = torch.Generator().manual_seed(V + int(scale))
    row = normal_logits(1, V, gen, scale=scale)
    temp, top_k, top_p, min_p = setting
    args = sample_args(row.expand(N, -1).contiguous(), [(*setting, 0.0, 0.0)] * N, [12345] * N, list(range(N)), gen)
    got, _ = run_kernel(be, "sample", args, domain)
    ids, probs = kept_probabilities(row[0].float(), temp, top_k, top_p, min_p, domain)
    kept = torch.zeros(domain, dtype=torch.bool)
    kept[ids] = True
    assert kept[got.long()].all(), "an id outside the kept set was drawn"
    # chi-square over ids expected >= 8 times, the rest pooled
    expected = probs * N
    big = expected >= 8
    observed = torch.bincount(got.long(), minlength=domain)[ids].double()
    cells_o = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    cells_e = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    use = cells_e > 0
    chi2 = (((cells_o - cells_e) ** 2) / cells_e)[use].sum().item()
    df = max(int(use.sum()) - 1, 1)
    bound = df + 6 * math.sqrt(2 * df)
    assert chi2 < bound, f"chi-square {chi2:.1f} over {df} degrees of freedom (bound {bound:.1f})"
    sl = slice(0, 256)
    want = run_ref(ref, "sample", {k: v[sl].contiguous() for k, v in args.items()}, domain)
    assert torch.equal(got[sl], want), f"{int((got[sl] != want).sum())} of 256 draws differ from the reference"
