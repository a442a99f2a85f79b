"""What the GDN GPU test files share (each makes its own inputs)."""
import torch

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
