"""One dispatch interface, two backends.

    backend.plan(op, y=..., x=..., w=..., eps=1e-6) -> a callable that runs the op on those buffers
    backend.run(op, ...)                             -> plan + call (tests, one-off calls)

`cuda` resolves the route from the manifest's route table for (arch, dtype, exact problem, T), checks
the route's constraints and packs the kernel arguments once; calling the plan only launches, so a
sequence of plans can be captured in a CUDA graph. `reference` runs each op's torch reference (any
device, CPU in CI) through the same interface.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import os
from collections import OrderedDict
from typing import Callable

import torch

from .contracts import TORCH_DTYPES, ContractError, bind
from .manifest import Manifest, RouteError, evaluate
from .reference_quant import ALL_REFERENCES as REFERENCES


def _split(contract: dict, args: dict) -> tuple[dict, dict]:
    tensor_names = set(contract["inputs"]) | set(contract["outputs"]) | set(contract["states"])
    tensors = {k: v for k, v in args.items() if k in tensor_names or isinstance(v, torch.Tensor)}
    params = {k: v for k, v in args.items() if k not in tensors}
    return tensors, params


def _dtype_of(op: str, contract: dict, tensors: dict) -> str:
    by_torch = {v: k for k, v in TORCH_DTYPES.items()}
    for name, spec in {**contract["inputs"], **contract["states"], **contract["outputs"]}.items():
        if spec["dtype"] == "$dtype" and isinstance(tensors.get(name), torch.Tensor):
            if tensors[name].dtype not in by_torch:
                raise ContractError(f"{op}: argument {name} has unsupported dtype {tensors[name].dtype}")
            return by_torch[tensors[name].dtype]
    return contract["dtypes"][0]


def _check_aliasing(op: str, contract: dict, tensors: dict) -> None:
    written = [*contract["outputs"], *contract["states"]]
    for out in written:
        for other in [*contract["inputs"], *contract["states"], *contract["outputs"]]:
            if other == out:
                continue
            if tensors[out].data_ptr() == tensors[other].data_ptr() and contract["aliases"].get(out) != other:
                raise ContractError(f"{op}: {out} shares memory with {other}, which the contract does not allow")


@functools.lru_cache(maxsize=None)
def _wants(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def forced_routes(text: str) -> dict[str, str]:
    """"op=route.tile,op2=route.tile" -> {op: route.tile} (empty text: none)."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        op, sep, inst = item.partition("=")
        if not (sep and op and inst.count(".") == 1):
            raise ValueError(f"NINFER_ROUTES: {item!r} is not op=route.tile (e.g. gdn_delta_rule=chunked.v32)")
        out[op] = inst
    return out


class Backend:
    name = "?"

    def __init__(self, manifest: Manifest | None = None):
        self.manifest = manifest or Manifest.load()

    def contract(self, op: str) -> dict:
        try:
            return self.manifest.ops[op]
        except KeyError:
            raise ContractError(f"unknown op {op!r} (known: {', '.join(sorted(self.manifest.ops))})") from None

    def workspace_bytes(self, op: str, **dims) -> int:
        """Scratch memory `op` may take at these dims (the memory plan reserves it); the reference backend needs none."""
        return 0

    def has_op(self, op: str, dtype: str = "bf16") -> bool:
        """Whether this backend runs `op` (the reference backend runs every op; cuda, those with kernels here)."""
        return op in self.manifest.ops

    def resolved_route(self, op: str, **dims) -> str | None:
        """The route `op` runs on at these dims (T included) by this backend's tables, where its constraints hold;
        None where the backend has no such table (the reference backend: none)."""
        return None

    def admits(self, op: str, **dims) -> bool:
        """Whether this backend runs `op` at these dims (T included): the reference backend every op at any dims; cuda
        where its table's route at T admits them."""
        return self.has_op(op)

    def takes_packed(self, op: str, **dims) -> bool:
        """Whether `op` (a packed-weight op such as linear_q4) runs at these dims on a route that reads the packed
        matrix in a prefill GEMM (`wgmma_rs*`: decoded inside the GEMM), so the model need not dequantize it first."""
        return (self.resolved_route(op, **dims) or "").startswith("wgmma_rs")

    def plan(self, op: str, *, route: str | None = None, **args) -> Callable[[], None]:
        raise NotImplementedError

    @contextlib.contextmanager
    def beside(self):
        """Plans made inside run beside the others, on another CUDA stream (the MoE shared expert's fork,
        models/blocks.py; a speculative round's commit, verify_graph.py): the cuda backend gives them their own
        workspace, one for all such plans (the commit's gdn_verify declares none, so it shares nothing with a shared
        expert running at the same time). Nothing to do for the reference backend."""
        yield

    def run(self, op: str, *, route: str | None = None, **args) -> None:
        self.plan(op, route=route, **args)()


class ReferenceBackend(Backend):
    name = "reference"

    def plan(self, op: str, *, route: str | None = None, **args):
        contract = self.contract(op)
        tensors, params = _split(contract, args)
        dtype = _dtype_of(op, contract, tensors)
        dims, params = bind(op, contract, dtype, tensors, params)
        _check_aliasing(op, contract, tensors)
        fn = REFERENCES.get(contract["reference"])
        if fn is None:
            raise ContractError(f"{op}: its contract names reference {contract['reference']!r}, which "
                                f"ninfer.runtime.reference does not define")
        ins = {k: tensors[k] for k in [*contract["inputs"], *contract["states"]]}
        outs = {k: tensors[k] for k in [*contract["outputs"], *contract["states"]]}

        # dims: the bound sizes; store: the op's storage dtype, for references that round an intermediate into it
        extra = {k: v for k, v in (("dims", dims), ("store", TORCH_DTYPES[dtype])) if _wants(fn, k)}

        def call():
            # fp32 math (fp64 stays fp64: the test oracles); the result is rounded once into each output
            wide = {k: (v.float() if v.is_floating_point() and v.dtype != torch.float64 else v) for k, v in ins.items()}
            result = fn(**wide, **params, **extra)
            for k, t in outs.items():
                t.copy_(result[k])

        return call


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, manifest: Manifest | None = None, device_index: int | None = None):
        super().__init__(manifest)
        from .cuda import device
        self.device = device(device_index)
        self._modules: dict[str, object] = {}
        self._plans: OrderedDict = OrderedDict()
        self._workspaces: dict[bool, torch.Tensor] = {}   # False: the plans of the main stream, True: those beside() it
        self._side = False
        tuned = self.manifest.data.get("tuned", {})
        if tuned and not self.manifest.tuned_for(self.device.name, self.device.arch):
            import sys
            print(f"ninfer: tuned route tables exist for {', '.join(sorted(tuned))}, not for this "
                  f"{self.device.name} ({self.device.arch}): using the default tables", file=sys.stderr)

    PLAN_CACHE = 8192
    # programmatic dependent launch for kernels that support it (sm_90+); NINFER_PDL=0 turns it off (A/B runs)
    pdl = os.environ.get("NINFER_PDL", "1") != "0"
    # set to a list to record (op, route instance, dims, kernel symbol) of every run() (eager calls; graph replays
    # are not seen): `ninfer-bench model --profile` matches them with the kernels' CUPTI times. Launches planned
    # meanwhile go without PDL (plans are cached per setting): a kernel let in early would count its wait for the one
    # before.
    profile: list | None = None

    @property
    def _pdl_now(self) -> bool:
        return self.pdl and self.profile is None

    def run(self, op: str, *, route: str | None = None, **args) -> None:
        launch = self.plan(op, route=route, **args)
        if self.profile is not None:
            self.profile.append((op, launch.kernel.instance, launch.dims, launch.kernel.symbol))
        launch()

    def plan(self, op: str, *, route: str | None = None, **args):
        """Plans are cached by everything that determines them (op, route, each tensor's address, shape,
        strides and dtype, each scalar): eager prefill re-plans ~800 calls per chunk and the caching allocator hands out
        the same buffers chunk after chunk, so a repeat costs a dict lookup instead of a bind + resolve."""
        key = (op, route, self._side, self._pdl_now,
               *((k, v.data_ptr(), v.shape, v.stride(), v.dtype) if isinstance(v, torch.Tensor) else (k, v)
                 for k, v in args.items()))
        hit = self._plans.get(key)
        if hit is not None:
            self._plans.move_to_end(key)
            return hit
        launch = self._plan(op, route=route, **args)
        self._plans[key] = launch
        if len(self._plans) > self.PLAN_CACHE:
            self._plans.popitem(last=False)
        return launch

    def module(self, kernel, pre: bool = False) -> object:
        """The loaded kernel function (pre: the route's `<symbol>_pre`, from the same cubin)."""
        from .cubins import check_arch, compile_kernel
        from .cuda import Module
        key = kernel.key + ("/pre" if pre else "")
        mod = self._modules.get(key)
        if mod is None:
            path, _, _ = compile_kernel(kernel.data)  # cached by `make build`; compiled here only if missing
            cubin = path.read_bytes()
            check_arch(cubin, kernel.data, self.device.cc)
            launch = kernel.pre if pre else kernel.data
            mod = self._modules[key] = Module(cubin, launch["symbol"], int(evaluate(launch["smem"], {})))
        return mod

    def workspace_bytes(self, op: str, **dims) -> int:
        return self.manifest.workspace_bytes(self.device.arch, op, dims)

    def has_op(self, op: str, dtype: str = "bf16") -> bool:
        return dtype in self.manifest.data["tables"].get(self.device.arch, {}).get(op, {})

    def resolved_route(self, op: str, **dims) -> str | None:
        if not self.has_op(op):
            return None
        contract = self.contract(op)
        kernel = self.manifest.resolve(self.device.arch, op, "bf16", {d: dims[d] for d in contract["problem"]},
                                       dims["T"], self.device.name)
        env = {**dims, "SMS": self.device.sm_count}
        return kernel.route if all(evaluate(c, env) for c in kernel.constraints) else None

    def admits(self, op: str, **dims) -> bool:
        return self.resolved_route(op, **dims) is not None

    @contextlib.contextmanager
    def beside(self):
        was, self._side = self._side, True
        try:
            yield
        finally:
            self._side = was

    def workspace(self, nbytes: int):
        """Scratch memory for routes that declare a workspace: one buffer serves every plan of the main stream
        (launches there are ordered, so a route's pre kernel and main kernel finish with it before the next route
        starts), another the plans made beside() it, which run at the same time. Growing one leaves the old buffer
        to the plans that hold it."""
        buf = self._workspaces.get(self._side)
        if buf is None or buf.numel() < nbytes:
            buf = self._workspaces[self._side] = torch.empty(max(nbytes, 1), dtype=torch.uint8,
                                                             device=f"cuda:{self.device.index}")
        return buf

    # NINFER_ROUTES="op=route.tile,..." runs those ops on one route instance at every T (whole-model A/B runs)
    forced = forced_routes(os.environ.get("NINFER_ROUTES", ""))

    def select(self, op: str, dtype: str, dims: dict, route: str | None = None):
        """The kernel for this exact problem and T: from the route table, or a named `route.tile` (tests, tuning)."""
        contract = self.contract(op)
        problem = {d: dims[d] for d in contract["problem"]}
        arch = self.device.arch
        route = route or self.forced.get(op)
        if route is None:
            return self.manifest.resolve(arch, op, dtype, problem, dims["T"], self.device.name)
        return self.manifest.kernel(arch, op, route, dtype)

    def _plan(self, op: str, *, route: str | None = None, **args):
        from .cuda import Launch, encode_tmap, encode_tmap_codes
        contract = self.contract(op)
        tensors, params = _split(contract, args)
        dtype = _dtype_of(op, contract, tensors)
        dims, params = bind(op, contract, dtype, tensors, params)
        _check_aliasing(op, contract, tensors)
        for name, t in tensors.items():
            if t.device.type != "cuda":
                raise ContractError(f"{op}: argument {name} is on {t.device}; the cuda backend needs GPU tensors")
            if t.data_ptr() % 16:
                raise ContractError(f"{op}: argument {name} is not 16-byte aligned")
        kernel = self.select(op, dtype, dims, route)
        env = {**dims, **params, "SMS": self.device.sm_count}  # SMS: grid formulas only (codegen checks)
        for c in kernel.constraints:
            if not evaluate(c, env):
                shown = ", ".join(f"{k}={v}" for k, v in dims.items())
                raise RouteError(f"{op}: route {kernel.instance} ({kernel.arch}) requires {c}, which fails for {shown}")
        values, hold = [], None
        for a in kernel.args:
            if a == "workspace":
                hold = self.workspace(int(evaluate(kernel.workspace, env)))
                values.append(ctypes.c_uint64(hold.data_ptr()))
            elif isinstance(a, dict) and "format" in a:   # a plane of a packed matrix (codes, high bits)
                rows, cols = (int(evaluate(e, env)) for e in a["matrix"])
                values.append(encode_tmap_codes(tensors[a["tmap"]].data_ptr(), a["format"], rows, cols, *a["box"],
                                                plane=a.get("plane", 0), swizzle=a.get("swizzle", "NONE")))
            elif isinstance(a, dict):   # a box over every dim of the tensor, or over [rows, cols] of a 2-D view
                t = tensors[a["tmap"]]
                if not t.is_contiguous():
                    raise ContractError(f"{op}: argument {a['tmap']} must be contiguous (route {kernel.instance} "
                                        f"reads it through a tensor map)")
                shape = t.shape if len(a["box"]) == t.dim() else (t.shape[0], t.shape[-1])
                values.append(encode_tmap(t.data_ptr(), t.dtype, shape, a["box"]))
            elif a in tensors:
                values.append(ctypes.c_uint64(tensors[a].data_ptr()))
            elif a in dims:
                values.append(ctypes.c_int32(dims[a]))
            elif contract["params"][a]["type"] == "f32":
                values.append(ctypes.c_float(params[a]))
            else:
                values.append(ctypes.c_int32(params[a]))
        pdl = self._pdl_now and kernel.data.get("pdl", False) and self.device.cc >= 90

        def launch_of(geometry: dict, pre: bool = False):   # geometry: the kernel's record, or its `pre` entry
            grid = tuple(int(evaluate(g, env)) for g in geometry["grid"])
            block = tuple(int(evaluate(b, env)) for b in geometry["block"])
            return Launch(self.module(kernel, pre), grid, block, int(evaluate(geometry["smem"], env)), values, pdl)

        launch = launch_of(kernel.data)
        if "pre" in kernel.data:  # the pre kernel takes the same arguments and runs first
            launch = Sequence(launch_of(kernel.pre, pre=True), launch)
        launch.kernel, launch.dims, launch.workspace = kernel, dims, hold
        return launch


class Sequence:
    """Launches issued one after another on the same stream, called like one Launch."""

    def __init__(self, *launches):
        self.launches = launches

    def __call__(self, stream_handle: int | None = None) -> None:
        for launch in self.launches:
            launch(stream_handle)


def backend(name: str = "auto", manifest: Manifest | None = None) -> Backend:
    """`cuda` when a GPU is present (auto), else `reference`."""
    if name == "auto":
        from .cuda import gpu_available
        name = "cuda" if gpu_available() else "reference"
    if name == "cuda":
        return CudaBackend(manifest)
    if name == "reference":
        return ReferenceBackend(manifest)
    raise ValueError(f"unknown backend {name!r} (allowed: auto, cuda, reference)")
