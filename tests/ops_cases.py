"""Shared op test cases: random inputs (never zeros) for a problem, and the fp64 oracle.

Used by the CPU tests (reference backend) and the GPU tests (every route of every op).
"""
import torch

from ninfer.runtime.contracts import TORCH_DTYPES, shape_of
from ninfer.runtime.dispatch import _dtype_of, _wants
from ninfer.runtime.reference_quant import ALL_REFERENCES as REFERENCES

# Problems per op: a small odd-sized one and a real 27B-shaped one.
PROBLEMS = {
    "rms_norm": [{"H": 128}, {"H": 5120}],
    "rms_norm_zc": [{"H": 256}, {"H": 5120}],
    "add_rms_norm_zc": [{"H": 264}, {"H": 5120}],
    "sigmoid_gate_add_rms_norm_zc": [{"H": 264}, {"H": 2048}, {"H": 5120}],
    "add": [{"H": 264}, {"H": 5120}],
    "silu_and_mul": [{"I": 136}, {"I": 17408}],
    "sigmoid_mul": [{"N": 200}, {"N": 6144}],
    "embedding": [{"V": 1000, "H": 64}, {"V": 248320, "H": 5120}],
    "linear": [{"N": 136, "K": 200}, {"N": 1024, "K": 5120}, {"N": 77, "K": 200}, {"N": 1, "K": 512}, {"N": 96, "K": 5120}],
    # the 27B MLP, a width that ends inside a tile (the gate box reads up rows there), a tiny odd one
    "linear_swiglu": [{"I": 17408, "K": 5120}, {"I": 200, "K": 256}, {"I": 68, "K": 200}],
}


def make_inputs(contract, dims, device, gen, dtype="bf16"):
    """Inputs drawn fresh from N(0,1) (ids uniform, a few out of range for embedding); outputs poisoned with NaN."""
    ts = {}
    for name, spec in contract["inputs"].items():
        dt = TORCH_DTYPES[dtype if spec["dtype"] == "$dtype" else spec["dtype"]]
        shape = shape_of(spec, dims)
        if dt == torch.int32:
            ts[name] = torch.randint(0, dims["V"], shape, generator=gen, dtype=dt).to(device)
        else:
            scale = 0.5 if name == "w" and "H" in dims else 1.0
            ts[name] = (torch.randn(shape, generator=gen) * scale).to(dt).to(device)
    for name, spec in contract["outputs"].items():
        dt = TORCH_DTYPES[dtype if spec["dtype"] == "$dtype" else spec["dtype"]]
        ts[name] = torch.full(shape_of(spec, dims), float("nan"), dtype=dt, device=device)
    return ts


def oracle(op, contract, tensors, params):
    """fp64 (on the tensors' device) reference from the represented inputs, before the one output rounding (an
    intermediate the contract stores, as sigmoid_gate_add_rms_norm_zc's m, rounded into the tensors' dtype)."""
    fn = REFERENCES[contract["reference"]]
    ins = {k: (tensors[k].double() if tensors[k].is_floating_point() else tensors[k]) for k in contract["inputs"]}
    if _wants(fn, "store"):   # as the reference backend passes it
        params = {**params, "store": TORCH_DTYPES[_dtype_of(op, contract, tensors)]}
    return fn(**ins, **params)


def boundary_ts(spans):
    """T = 1, then b-1, b, b+1 for every span start b, and an interior point of every span."""
    ts = {1}
    for lo, hi, _ in spans:
        if lo > 1:
            ts |= {lo - 1, lo, lo + 1}
        ts.add((lo + hi) // 2 if hi is not None else 2 * lo + 37)
    return sorted(ts)


def gpu_kernels(ops) -> list:
    """This GPU's route instances of `ops` (sorted), or [] without a GPU: the GPU tests' every-route cases."""
    from ninfer.runtime.cuda import device, gpu_available
    from ninfer.runtime.manifest import Manifest
    if not gpu_available():
        return []
    arch = device().arch
    return sorted((k for k in Manifest.load().kernels.values() if k.arch == arch and k.op in ops), key=lambda k: k.key)
