"""gdn_decode (the fused GDN decode step) on the GPU against the reference backend run on cloned GPU tensors,
under the op's gdn_state_fp32 preset for y and the fp32 state (the conv state must match exactly: raw bf16
inputs are moved, never rounded): the Qwen3.6-27B and 35B-A3B shapes, small odd ones (DK < 128, DV not a
multiple of 4, 1 to 5 value heads per key head), 1..9 and 39 sequences, every route instance on every
shape its constraints admit, states carried over consecutive decode steps, and a CUDA-graph replay bitwise
equal to eager. Skips cleanly without a GPU (the `gpu` marker)."""
import pytest
import torch

from ninfer.runtime.manifest import RouteError, evaluate
from tests.gpu.gdn import (check_against_reference, check_graph_replay_equals_eager, check_unused_slots_untouched,
                           clone)
from tests.ops_cases import gpu_kernels

pytestmark = pytest.mark.gpu

# name: (H hidden, HK key heads, R value heads per key head, DK, DV)
SHAPES = {
    "27b": (5120, 16, 3, 128, 128),
    "35b": (2048, 16, 2, 128, 128),
    "tiny": (64, 2, 2, 32, 32),
    "odd": (72, 1, 3, 96, 40),
    "r1": (128, 4, 1, 64, 64),
    "r4": (136, 2, 4, 128, 100),
    "r5": (256, 2, 5, 128, 128),
    "ragged": (88, 1, 2, 126, 42),    # DK not a multiple of 8, DV not a multiple of 4 (scalar state access)
}
KW = 4


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(g, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


def decode_inputs(shape, T, seed, spare=3):
    H, hk, r, dk, dv = shape
    C = 2 * hk * dk + hk * r * dv
    NS = T + spare
    g = gen(seed)
    return {
        "x": randn(g, T, H), "qkvz": randn(g, T, C + hk * r * dv),
        "w_ba": randn(g, 2, hk, r, H, scale=H ** -0.5),      # b, a ~ N(0, 1)
        "conv_w": randn(g, C, KW, scale=0.5),
        "A_log": randn(g, hk, r, dtype=torch.float32), "dt_bias": randn(g, hk, r, dtype=torch.float32),
        "norm_w": randn(g, dv, scale=0.5) + 1,
        "slots": torch.randperm(NS, device="cuda", generator=g)[:T].to(torch.int32),
        "conv_state": randn(g, NS, C, KW - 1),
        "state": randn(g, NS, hk, r, dk, dv, scale=0.5, dtype=torch.float32),
        "y": torch.full((T, hk, r, dv), float("nan"), dtype=torch.bfloat16, device="cuda"),
        "scale": dk ** -0.5, "norm_eps": 1e-6,
    }


def check(be, ts, route=None, what="", ref_ts=None):
    """Run the kernel and the reference (on `ref_ts`, or a clone of ts); compare y and state under
    gdn_state_fp32, and the conv state exactly."""
    used, ref_ts = check_against_reference(be, "gdn_decode", ts, route, what, ref_ts)
    assert torch.equal(ts["conv_state"], ref_ts["conv_state"]), f"conv_state differs {what}"
    return used


@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("T", [1, 2, 3, 8, 9, 39])
def test_gdn_decode_table(be, shape, T):
    check(be, decode_inputs(SHAPES[shape], T, seed=T * 13 + len(shape)), what=f"{shape} T={T}")


def route_cases():
    cases = []
    for k in gpu_kernels({"gdn_decode"}):
        for name, (H, hk, r, dk, dv) in SHAPES.items():
            env = {"H": H, "HK": hk, "R": r, "DK": dk, "DV": dv, "KW": KW}
            if all(evaluate(c, env) for c in k.constraints):
                cases += [(k.instance, name, T) for T in (1, 5)]
    return cases


@pytest.mark.parametrize("route,shape,T", route_cases(), ids=lambda v: str(v))
def test_every_route(be, route, shape, T):
    assert check(be, decode_inputs(SHAPES[shape], T, seed=T * 7 + 3), route=route, what=f"{shape} T={T}") == route


@pytest.mark.parametrize("shape", ["27b", "35b", "odd"])
def test_gdn_decode_state_carried(be, shape):
    """Six decode steps on the same slots: the kernel's and the reference's states evolve independently and
    are compared after every step, so what one step writes is what the next one reads."""
    ts = decode_inputs(SHAPES[shape], 3, seed=77)
    ref_ts = clone(ts)
    g = gen(78)
    for step in range(6):
        for name in ("x", "qkvz"):
            ts[name].copy_(randn(g, *ts[name].shape))
            ref_ts[name].copy_(ts[name])
        check(be, ts, what=f"{shape} step {step}", ref_ts=ref_ts)


def test_unused_slots_untouched(be):
    check_unused_slots_untouched(be, "gdn_decode", decode_inputs(SHAPES["tiny"], 2, seed=5, spare=4))


def test_bad_dims_are_refused(be):
    ts = decode_inputs((64, 1, 2, 256, 32), 1, seed=2)
    with pytest.raises(RouteError, match=r"gdn_decode: route head\.g1 \(sm_\w+\) requires DK <= 128"):
        be.plan("gdn_decode", **ts)


def test_graph_replay_equals_eager(be):
    check_graph_replay_equals_eager(be, "gdn_decode", decode_inputs(SHAPES["27b"], 4, seed=9), seed=10)
