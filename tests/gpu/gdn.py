"""What the two GDN GPU test files share (each makes its own inputs)."""
import torch

from ninfer.runtime.dispatch import ReferenceBackend
from ninfer.runtime.tolerance import compare


def clone(ts):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in ts.items()}


def check_state_carried(be, make_inputs, state, slots, calls, label):
    """gdn_delta_rule call after call on the same state slots (calls: each call's run lengths), the kernel's
    and the reference's states evolving independently; o and the state are compared after every call, so
    the state one call (route) writes is what the next one reads. make_inputs(runs, seed, state, slots)."""
    ref_state = state.clone()
    preset = be.manifest.tolerances["gdn_state_fp32"]
    for i, runs in enumerate(calls):
        ts = make_inputs(runs, seed=100 + i, state=state, slots=slots)
        ref_ts = clone(ts)
        ref_ts["state"] = ref_state
        be.run("gdn_delta_rule", **ts)
        ReferenceBackend(be.manifest).run("gdn_delta_rule", **ref_ts)
        torch.cuda.synchronize()
        for name in ("o", "state"):
            v = compare(ts[name], ref_ts[name], preset, f"gdn_delta_rule.{name} {label} call {i} runs={runs}")
            assert v, v.detail
