"""gdn_verify (a speculative verify step's fused GDN mixer) on the GPU against the reference backend run on cloned GPU
tensors, under the op's gdn_state_fp32 preset for y and the fp32 state (the conv state must match exactly: raw bf16
inputs are moved, never rounded): the Qwen3.6-27B and 35B-A3B shapes and small odd ones, runs of 1..17 tokens (the
kernel's 8-token chunks: 7, 8, 9, 16, 17), commit counts 0 (nothing written), 1, inside the run and the whole run,
the span boundary of the real shapes' tables (T = 16 / 17 / 18: cluster register tiles, then head.g1), every
route instance on every shape its constraints admit, a verify + commit pair against decode steps, states
untouched in other slots, and a CUDA-graph replay bitwise equal to eager. Skips cleanly without a GPU."""
import pytest
import torch

from ninfer.runtime.manifest import evaluate
from ninfer.runtime.tolerance import compare
from tests.gpu.gdn import (check_against_reference, check_graph_replay_equals_eager, check_unused_slots_untouched,
                           clone)
from tests.gpu.test_gdn_decode_gpu import SHAPES, KW, decode_inputs
from tests.ops_cases import gpu_kernels

pytestmark = pytest.mark.gpu


def verify_inputs(shape, runs, commit, seed, spare=3):
    """gdn_decode's inputs for sum(runs) tokens, the runs' query_start, their slots and commit counts (a callable of
    the run length, or a list)."""
    T, S = sum(runs), len(runs)
    ts = decode_inputs(shape, T, seed, spare=spare + T - S)   # (its slots: T of them; a run takes one)
    ts["slots"] = ts["slots"][:S].contiguous()
    ts["query_start"] = torch.tensor([0, *torch.tensor(runs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    c = commit if isinstance(commit, list) else [commit(n) for n in runs]
    ts["commit"] = torch.tensor(c, dtype=torch.int32, device="cuda")
    return ts


def check(be, ts, route=None, what="", ref_ts=None):
    used, ref_ts = check_against_reference(be, "gdn_verify", ts, route, what, ref_ts)
    assert torch.equal(ts["conv_state"], ref_ts["conv_state"]), f"conv_state differs {what}"
    return used


COMMITS = {"none": lambda n: 0, "one": lambda n: 1, "inside": lambda n: max(1, n // 2), "all": lambda n: n}


@pytest.mark.parametrize("shape", ["27b", "35b", "odd", "r4", "ragged"], ids=str)
# T = 1, the real shapes' span boundary 17 (16, 17, 18 tokens) and beyond it; runs across the 8-token chunks
@pytest.mark.parametrize("runs", [[1], [4], [4, 4, 4, 4], [4, 4, 4, 4, 1], [9, 9], [7, 8, 9], [4, 4, 4, 4, 4, 4, 4, 4],
                                  [16, 1, 17], [2, 9, 5]], ids=str)
@pytest.mark.parametrize("commit", list(COMMITS))
def test_gdn_verify_table(be, shape, runs, commit):
    check(be, verify_inputs(SHAPES[shape], runs, COMMITS[commit], seed=len(runs) * 31 + sum(runs)),
          what=f"{shape} runs={runs} commit={commit}")


def route_cases():
    cases = []
    for k in gpu_kernels({"gdn_verify"}):
        for name, (H, hk, r, dk, dv) in SHAPES.items():
            for runs in ((4,), (9, 1, 3), (4,) * 8, (20, 17)):   # 8 lanes of K = 3; runs past 16 tokens
                env = {"H": H, "HK": hk, "R": r, "DK": dk, "DV": dv, "KW": KW, "T": sum(runs)}
                if all(evaluate(c, env) for c in k.constraints):
                    cases.append((k.instance, name, runs))
    return cases


@pytest.mark.parametrize("route,shape,runs", route_cases(), ids=lambda v: str(v))
def test_every_route(be, route, shape, runs):
    ts = verify_inputs(SHAPES[shape], list(runs), [max(1, n - 1) for n in runs], seed=sum(runs) * 7 + 3)
    assert check(be, ts, route=route, what=f"{shape} runs={runs}") == route


@pytest.mark.parametrize("shape", ["27b", "35b", "odd"])
def test_verify_then_commit_equals_decode_steps(be, shape):
    """A round as the engine runs it: verify (commit 0) leaves the states; the commit of the kept tokens (the same
    inputs) leaves them as that many gdn_decode steps do; y of the verify equals the decode steps' y there."""
    runs, kept = [4, 4, 4], [1, 3, 4]
    ts = verify_inputs(SHAPES[shape], runs, [0, 0, 0], seed=41)
    before = {k: ts[k].clone() for k in ("state", "conv_state")}
    be.run("gdn_verify", **ts)
    torch.cuda.synchronize()
    for k, t in before.items():
        assert torch.equal(ts[k], t), f"the verify wrote {k}"
    y_verify = ts["y"].clone()
    ts["commit"].copy_(torch.tensor(kept, dtype=torch.int32))
    be.run("gdn_verify", **ts)
    steps = clone(ts)
    steps["state"].copy_(before["state"])
    steps["conv_state"].copy_(before["conv_state"])
    preset = be.manifest.tolerances["gdn_state_fp32"]
    for i in range(max(runs)):   # decode step i: token i of each run still kept
        lanes = [s for s, n in enumerate(kept) if i < n]
        rows = torch.tensor([s * 4 + i for s in lanes], device="cuda")
        step = {k: steps[k] for k in ("w_ba", "conv_w", "A_log", "dt_bias", "norm_w", "conv_state", "state",
                                      "scale", "norm_eps")}
        step |= {"x": steps["x"][rows], "qkvz": steps["qkvz"][rows], "slots": steps["slots"][lanes].contiguous(),
                 "y": torch.empty_like(steps["y"][rows])}
        if lanes:
            be.run("gdn_decode", **step)
            v = compare(step["y"], y_verify[rows], preset, f"y of token {i}")
            assert v, v.detail
    torch.cuda.synchronize()
    for k in ("state", "conv_state"):
        v = compare(ts[k], steps[k], preset, f"{k} after the commit")
        assert v, v.detail


def test_unused_slots_untouched(be):
    check_unused_slots_untouched(be, "gdn_verify", verify_inputs(SHAPES["tiny"], [3, 2], [3, 1], seed=5, spare=4))


def test_graph_replay_equals_eager(be):
    check_graph_replay_equals_eager(be, "gdn_verify", verify_inputs(SHAPES["27b"], [4, 4], [2, 4], seed=9), seed=10)
