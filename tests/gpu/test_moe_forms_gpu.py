"""The two other forms of the packed MoE experts on the GPU, against the reference backend on cloned GPU tensors
with the contracts' tolerances: the decode form (moe_gate_up_<fmt>, then moe_down_<fmt>) and the prefill form
(moe_align, moe_gate_up_grouped_<fmt>, moe_down_grouped_<fmt>, moe_sum), every route instance, the
Qwen3.6-35B-A3B shape and small shapes whose expert slices start mid-tile, ids outside [0, E), poisoned
unselected experts, CUDA-graph capture; each form end to end against moe_experts_<fmt>. A file of its own: each
GPU test file runs in its own process under a time limit (tests/gpu/h200_run.sh)."""
import pytest
import torch

from ninfer.runtime.reference_quant import PACKED, moe_op
from tests.gpu.test_moe_packed_gpu import (ODD, REAL, SMALL, check, check_replays, gen, inputs, instances, name,
                                           nan_like, poison_unselected, reference)

pytestmark = pytest.mark.gpu


# ---- the split form: moe_gate_up_<fmt> (h = silu(gate) * up per slot), then moe_down_<fmt> ---------------------------
SPLIT_CASES = [(REAL, 1), (REAL, 8), (REAL, 16)] + [(s, T) for s in (ODD, SMALL) for T in (1, 2, 8, 33)]


def split_reference(ref, fmt, ins, shape):
    """(h, y) of the reference backend: h from moe_gate_up_<fmt>, y from moe_down_<fmt> over that h."""
    T, K, I, E = ins["x"].shape[0], shape["K"], shape["I"], shape["E"]
    h = torch.full((T, K, I), float("nan"), device="cuda")
    ref.run(f"moe_gate_up_{fmt}", x=ins["x"].clone(), gate_up=ins["gate_up"].clone(), ids=ins["ids"].clone(), h=h, E=E)
    y = nan_like((T, shape["H"]))
    ref.run(f"moe_down_{fmt}", h=h.clone(), down=ins["down"].clone(), weights=ins["weights"].clone(),
            ids=ins["ids"].clone(), y=y, E=E)
    return h, y


def run_split(be, fmt, ins, shape, h_in=None, gu_route=None, dn_route=None):
    """h and y on the GPU: moe_down reads h_in when given (its own check), else the h just computed."""
    T, K, I, E = ins["x"].shape[0], shape["K"], shape["I"], shape["E"]
    h = torch.full((T, K, I), float("nan"), device="cuda")
    be.run(f"moe_gate_up_{fmt}", route=gu_route, x=ins["x"], gate_up=ins["gate_up"], ids=ins["ids"], h=h, E=E)
    y = nan_like((T, shape["H"]))
    be.run(f"moe_down_{fmt}", route=dn_route, h=h if h_in is None else h_in, down=ins["down"], weights=ins["weights"],
           ids=ins["ids"], y=y, E=E)
    torch.cuda.synchronize()
    return h, y


@pytest.mark.parametrize("shape,T", SPLIT_CASES, ids=[f"{name(s)}-T{T}" for s, T in SPLIT_CASES])
@pytest.mark.parametrize("fmt", PACKED)
def test_split_every_route(be, ref, fmt, shape, T):
    """Each half against its reference (down over the reference h), for the table's route and every instance by
    name; the two halves together against the single-op reference moe_experts_<fmt>."""
    ins = inputs((fmt, fmt), shape, T, seed=T * 17 + shape["H"])
    want_h, want_y = split_reference(ref, fmt, ins, shape)
    gu, dn = f"moe_gate_up_{fmt}", f"moe_down_{fmt}"
    routes = [(None, None)] + [(g, None) for g in instances(be, gu)] + [(None, d) for d in instances(be, dn)]
    for gr, dr in routes:
        h, y = run_split(be, fmt, ins, shape, h_in=want_h, gu_route=gr, dn_route=dr)
        check(be, gu, h, want_h, f"{gu} {name(shape)} T={T} via {gr or 'table'}")
        check(be, dn, y, want_y, f"{dn} {name(shape)} T={T} via {dr or 'table'} (reference h)")
    _, y = run_split(be, fmt, ins, shape)
    check(be, moe_op(fmt, fmt), y, reference(ref, moe_op(fmt, fmt), ins, shape), f"{gu} + {dn} {name(shape)} T={T}")


@pytest.mark.parametrize("fmt", PACKED)
def test_split_skips_ids_outside_the_experts(be, ref, fmt):
    """A slot whose id is -1 or E gets h = 0 and adds nothing to y; the others are as the reference."""
    shape, T = ODD, 3
    ins = inputs((fmt, fmt), shape, T, seed=3)
    ins["ids"][0, 1] = -1
    ins["ids"][2, 0] = shape["E"]
    want_h, want_y = split_reference(ref, fmt, ins, shape)
    h, y = run_split(be, fmt, ins, shape)
    assert (h[0, 1] == 0).all() and (h[2, 0] == 0).all()
    check(be, f"moe_gate_up_{fmt}", h, want_h, f"moe_gate_up_{fmt} with ids -1 and E")
    check(be, f"moe_down_{fmt}", y, want_y, f"moe_down_{fmt} with ids -1 and E")


@pytest.mark.parametrize("fmt", PACKED)
def test_split_reads_only_selected_experts(be, ref, fmt):
    """Every byte of the experts no token selects is 0xFF (NaN scales): h and y stay finite and right."""
    shape = REAL
    ins = inputs((fmt, fmt), shape, 2, seed=41)
    want_h, want_y = split_reference(ref, fmt, ins, shape)
    h, y = run_split(be, fmt, poison_unselected(ins, (fmt, fmt), shape), shape)
    check(be, f"moe_gate_up_{fmt}", h, want_h, f"moe_gate_up_{fmt} poisoned unselected experts")
    check(be, f"moe_down_{fmt}", y, want_y, f"moe_down_{fmt} poisoned unselected experts")


def test_split_cuda_graph_t1(be, ref):
    """Both launches captured once and replayed on new x and routing: equal to eager, close to the reference."""
    fmt, shape = "q4", REAL
    ins = inputs((fmt, fmt), shape, 1, seed=77)
    h = torch.full((1, shape["K"], shape["I"]), float("nan"), device="cuda")
    y = nan_like((1, shape["H"]))
    gu = be.plan(f"moe_gate_up_{fmt}", x=ins["x"], gate_up=ins["gate_up"], ids=ins["ids"], h=h, E=shape["E"])
    dn = be.plan(f"moe_down_{fmt}", h=h, down=ins["down"], weights=ins["weights"], ids=ins["ids"], y=y, E=shape["E"])

    def both():
        gu()
        dn()
    check_replays(be, f"moe_down_{fmt}", both, y, ins, shape, 4321, lambda: split_reference(ref, fmt, ins, shape)[1],
                  "split form")


# ---- the grouped form: moe_align, moe_gate_up_grouped_<fmt>, moe_down_grouped_<fmt>, moe_sum -------------------------
GROUPED_CASES = [(REAL, 64, False), (REAL, 300, False), (REAL, 300, True)] + [
    (s, T, hot) for s in (ODD, SMALL) for T, hot in ((1, False), (9, False), (300, False), (300, True))]


def align(be, ids, E):
    order, offsets = torch.empty_like(ids), torch.empty(E, dtype=torch.int32, device=ids.device)
    be.run("moe_align", ids=ids, order=order, offsets=offsets)
    return order, offsets


@pytest.mark.parametrize("T,E,K", [(1, 256, 8), (7, 256, 8), (300, 256, 8), (4096, 256, 8), (1024, 512, 10), (33, 6, 2)])
def test_moe_align_is_the_reference_exactly(be, ref, T, E, K):
    """The stable sort by expert, ids outside [0, E) last (a few planted), bit for bit."""
    g = gen(T + E)
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(-1)[:, :K].to(torch.int32).contiguous()
    ids[0, 0] = -1
    ids[T // 2, K - 1] = E
    got, want = align(be, ids, E), align(ref, ids.clone(), E)
    assert torch.equal(got[1], want[1]), "offsets"
    assert torch.equal(got[0], want[0]), "order"


def make_hot(ids, e):
    """Slot 0 of every token on expert e (its passes then outnumber the blocks of all the other experts), the
    token's other slots kept distinct from it."""
    first = ids[:, :1].clone()
    ids[:, 1:] = torch.where(ids[:, 1:] == e, first.expand_as(ids[:, 1:]), ids[:, 1:])
    ids[:, 0] = e


@pytest.mark.parametrize("shape,T,hot", GROUPED_CASES,
                         ids=[f"{name(s)}-T{T}{'-hot' if hot else ''}" for s, T, hot in GROUPED_CASES])
@pytest.mark.parametrize("fmt", PACKED)
def test_grouped_every_route(be, ref, fmt, shape, T, hot):
    """Each grouped op against its reference (down over the reference h, moe_sum over the reference ys), the
    table's route and every instance by name; the whole form (moe_align on the GPU too) against moe_experts_<fmt>.
    `hot`: one expert takes every token's first slot (one expert's passes spread over many blocks)."""
    ins = inputs((fmt, fmt), shape, T, seed=T * 29 + shape["H"])
    if hot:
        make_hot(ins["ids"], shape["E"] // 2)
    if T > 1:  # a slot no expert owns
        ins["ids"][T - 1, 0] = -1
    K, I, H, E = shape["K"], shape["I"], shape["H"], shape["E"]
    order, offsets = align(ref, ins["ids"].clone(), E)
    gu, dn = f"moe_gate_up_grouped_{fmt}", f"moe_down_grouped_{fmt}"
    want_h = torch.full((T, K, I), float("nan"), device="cuda")
    ref.run(gu, x=ins["x"].clone(), gate_up=ins["gate_up"].clone(), order=order, offsets=offsets, h=want_h)
    want_ys = torch.full((T, K, H), float("nan"), device="cuda")
    ref.run(dn, h=want_h.clone(), down=ins["down"].clone(), weights=ins["weights"].clone(), order=order,
            offsets=offsets, ys=want_ys)
    for route in [None, *instances(be, gu)]:
        h = torch.full((T, K, I), float("nan"), device="cuda")
        be.run(gu, route=route, x=ins["x"], gate_up=ins["gate_up"], order=order, offsets=offsets, h=h)
        torch.cuda.synchronize()
        check(be, gu, h, want_h, f"{gu} {name(shape)} T={T} via {route or 'table'}")
    for route in [None, *instances(be, dn)]:
        ys = torch.full((T, K, H), float("nan"), device="cuda")
        be.run(dn, route=route, h=want_h, down=ins["down"], weights=ins["weights"], order=order, offsets=offsets, ys=ys)
        torch.cuda.synchronize()
        check(be, dn, ys, want_ys, f"{dn} {name(shape)} T={T} via {route or 'table'} (reference h)")
    y, want_y = nan_like((T, H)), nan_like((T, H))
    be.run("moe_sum", ys=want_ys, y=y)
    ref.run("moe_sum", ys=want_ys.clone(), y=want_y)
    torch.cuda.synchronize()
    check(be, "moe_sum", y, want_y, f"moe_sum {name(shape)} T={T}")

    go, gf = align(be, ins["ids"], E)
    h = torch.full((T, K, I), float("nan"), device="cuda")
    be.run(gu, x=ins["x"], gate_up=ins["gate_up"], order=go, offsets=gf, h=h)
    ys = torch.full((T, K, H), float("nan"), device="cuda")
    be.run(dn, h=h, down=ins["down"], weights=ins["weights"], order=go, offsets=gf, ys=ys)
    be.run("moe_sum", ys=ys, y=y)
    torch.cuda.synchronize()
    single = {**ins, "weights": ins["weights"].clone(), "ids": ins["ids"].clamp(0, E - 1)}
    single["weights"][ins["ids"] < 0] = 0
    check(be, moe_op(fmt, fmt), y, reference(ref, moe_op(fmt, fmt), single, shape), f"grouped form {name(shape)} T={T}")
