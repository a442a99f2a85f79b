"""What the GDN GPU test files share (each makes its own inputs)."""
import torch

from ninfer.runtime.decode_graph import capture
from ninfer.runtime.dispatch import ReferenceBackend
from ninfer.runtime.tolerance import compare


def clone(ts):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in ts.items()}


def check_against_reference(be, op, ts, route=None, what="", ref_ts=None):
    """Run `op` on the GPU kernel and on the reference backend (on ref_ts, by default a clone of ts); compare
    every output and state under the op's tolerance. Returns (route instance used, ref_ts)."""
    contract = be.contract(op)
    ref_ts = clone(ts) if ref_ts is None else ref_ts
    plan = be.plan(op, route=route, **ts)
    plan()
    torch.cuda.synchronize()
    ReferenceBackend(be.manifest).run(op, **ref_ts)
    torch.cuda.synchronize()
    preset = be.manifest.tolerances[contract["tolerance"]]
    for name in [*contract["outputs"], *contract["states"]]:
        v = compare(ts[name], ref_ts[name], preset, f"{op}.{name} {what} via {plan.kernel.instance}")
        assert v, v.detail
    return plan.kernel.instance, ref_ts


def check_state_carried(be, make_inputs, state, slots, calls, label):
    """gdn_delta_rule call after call on the same state slots (calls: each call's run lengths), the kernel's
    and the reference's states evolving independently; o and the state are compared after every call, so
    the state one call (route) writes is what the next one reads. make_inputs(runs, seed, state, slots)."""
    ref_state = state.clone()
    for i, runs in enumerate(calls):
        ts = make_inputs(runs, seed=100 + i, state=state, slots=slots)
        ref_ts = clone(ts)
        ref_ts["state"] = ref_state
        check_against_reference(be, "gdn_delta_rule", ts, what=f"{label} call {i} runs={runs}", ref_ts=ref_ts)


def check_unused_slots_untouched(be, op, ts):
    """A launch of `op` leaves the state and conv state of every slot it was not given as they were."""
    before = {k: ts[k].clone() for k in ("state", "conv_state")}
    be.run(op, **ts)
    torch.cuda.synchronize()
    used = set(ts["slots"].tolist())
    for k, t in before.items():
        for slot in range(t.shape[0]):
            if slot not in used:
                assert torch.equal(ts[k][slot], t[slot]), f"{k} slot {slot} changed"


def check_graph_replay_equals_eager(be, op, ts, seed):
    """`op` captured in a CUDA graph and replayed on new x, from the same states, writes what the eager launch writes,
    bit for bit (twice)."""
    st0, cs0 = ts["state"].clone(), ts["conv_state"].clone()
    plan = be.plan(op, **ts)
    graph = capture(plan)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for trial in range(2):
        ts["x"].copy_(torch.randn(ts["x"].shape, device="cuda", generator=g).to(ts["x"].dtype))
        ts["state"].copy_(st0)
        ts["conv_state"].copy_(cs0)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [ts[k].clone() for k in ("y", "state", "conv_state")]
        ts["state"].copy_(st0)
        ts["conv_state"].copy_(cs0)
        plan()
        torch.cuda.synchronize()
        for name, r in zip(("y", "state", "conv_state"), replayed):
            assert torch.equal(r, ts[name]), f"replay {trial}: {name} differs from eager"
