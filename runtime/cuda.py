"""CUDA driver access through cuda.bindings: device discovery, cubin modules, and pre-packed launches.

Device memory comes from torch; torch's primary context is the one we load modules into, and launches
go on torch's current stream, so our kernels and torch ops interleave (and capture into CUDA graphs).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

ARCH_BY_CC = {80: "sm_80", 86: "sm_86", 89: "sm_89", 90: "sm_90a", 120: "sm_120a"}


class CudaError(RuntimeError):
    pass


def gpu_available() -> bool:
    """True when a CUDA driver and at least one device are present. cuInit raises (not returns) without libcuda."""
    try:
        from cuda.bindings import driver
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, n = driver.cuDeviceGetCount()
        return err == driver.CUresult.CUDA_SUCCESS and n > 0
    except Exception:  # noqa: BLE001 - DynamicLibNotFoundError / RuntimeError when there is no libcuda
        return False


def check(result, what: str):
    """Unpack a cuda.bindings result tuple, raising CudaError with the driver's error name on failure."""
    from cuda.bindings import driver
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise CudaError(f"{what}: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else tuple(rest) if rest else None


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    cc: int
    arch: str
    sm_count: int
    smem_per_block_optin: int


@functools.lru_cache(maxsize=None)
def device(index: int | None = None) -> Device:
    import torch
    from cuda.bindings import driver
    if not gpu_available():
        raise CudaError("no CUDA GPU is available (the cuda backend needs one; use --backend reference)")
    index = torch.cuda.current_device() if index is None else index
    torch.cuda.init()
    torch.zeros(1, device=f"cuda:{index}")  # make torch's primary context current on this thread
    dev = check(driver.cuDeviceGet(index), "cuDeviceGet")
    ctx = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    attr = driver.CUdevice_attribute
    major = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "attr")
    minor = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "attr")
    sms = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "attr")
    smem = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev), "attr")
    cc = major * 10 + minor
    if cc not in ARCH_BY_CC:
        raise CudaError(f"compute capability {major}.{minor} has no target in specs/archs.yaml "
                        f"(supported: {', '.join(ARCH_BY_CC.values())})")
    return Device(index, torch.cuda.get_device_name(index), cc, ARCH_BY_CC[cc], sms, smem)


class Module:
    """A loaded cubin and its one kernel function."""

    def __init__(self, cubin: bytes, symbol: str, smem: int):
        from cuda.bindings import driver
        self._cubin = cubin  # keep the image alive for the module's lifetime
        self.module = check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({symbol})")
        self.function = check(driver.cuModuleGetFunction(self.module, symbol.encode()), f"cuModuleGetFunction({symbol})")
        # static + dynamic shared memory past the default 48 KB needs the opt-in
        static = check(driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                                 self.function), f"cuFuncGetAttribute({symbol})")
        if smem and smem + static > 48 * 1024:
            check(driver.cuFuncSetAttribute(
                self.function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                f"cuFuncSetAttribute({symbol}, smem={smem})")
        # a compiled-in cluster of more than 8 blocks (sm_90: up to 16) launches only with the opt-in
        width = check(driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH,
                                                self.function), f"cuFuncGetAttribute({symbol})")
        if width > 8:
            check(driver.cuFuncSetAttribute(
                self.function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                f"cuFuncSetAttribute({symbol}, non-portable cluster of {width})")


@functools.lru_cache(maxsize=64)
def _stream(handle: int):
    from cuda.bindings import driver
    return driver.CUstream(handle)


def _encode_tmap(dtype: str, ptr: int, dims: list, strides: list, box: list, swizzle: str):
    """A CUtensorMap (zero fill, 256-byte L2 promotion, unit element strides) as the 128 opaque bytes a kernel takes
    by value. dims and box innermost first; strides in bytes, one fewer than dims."""
    from cuda.bindings import driver
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t  # newer bindings refuse plain ints in these lists
    tmap = check(driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{dtype}"), len(dims), ptr,
        [u64(d) for d in dims], [u64(s) for s in strides], [u32(b) for b in box], [u32(1)] * len(dims),
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle}"),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    desc = (ctypes.c_uint64 * 16)()
    ctypes.memmove(ctypes.addressof(desc), tmap.getPtr(), 128)
    return desc


TMAP_DTYPES = {"torch.bfloat16": ("BFLOAT16", 2), "torch.uint8": ("UINT8", 1)}


def encode_tmap(ptr: int, dtype, shape: list, box: list):
    """A TMA descriptor (128-byte swizzle, zero fill) over a contiguous row-major bf16 or u8 tensor of this shape;
    shape and box outermost first (e.g. [rows, cols] and [box_rows, box_cols])."""
    if str(dtype) not in TMAP_DTYPES:
        raise ValueError(f"encode_tmap: {dtype} (allowed: {', '.join(TMAP_DTYPES)})")
    name, size = TMAP_DTYPES[str(dtype)]
    dims, box = [int(d) for d in reversed(shape)], [int(b) for b in reversed(box)]
    strides, stride = [], size
    for d in dims[:-1]:
        stride *= d
        strides.append(stride)
    return _encode_tmap(name, ptr, dims, strides, box, "128B")


def encode_tmap_codes(ptr: int, fmt: str, rows: int, cols: int, box_rows: int, box_bytes: int, plane: int = 0,
                      swizzle: str = "NONE"):
    """A 3-D TMA descriptor (u8, zero fill, no swizzle or 128B) over one plane of a packed [rows, cols] matrix
    (rowtile128-v1, specs/formats.md §3; plane 0: the codes, 1: q5 / q6's high bits): dims {the plane's bytes of a
    row, 128 rows, tiles}, so a box of box_rows rows (a divisor of 128) at (byte, row in tile, tile) stays inside one
    tile's plane. Whole tiles only."""
    from .format_base import PLANE_ALIGN, TILE_ROWS, align_up
    from .formats import get_format
    f = get_format(fmt)
    if rows % TILE_ROWS or TILE_ROWS % box_rows:
        raise ValueError(f"encode_tmap_codes: {rows} rows (a multiple of {TILE_ROWS} needed), box of {box_rows} rows")
    kp = align_up(cols, 128)
    sizes = f.plane_sizes(TILE_ROWS, kp)
    tile = sum(align_up(p, PLANE_ALIGN) for p in sizes)
    offset = sum(align_up(p, PLANE_ALIGN) for p in sizes[:plane])
    row_bytes = f.plane_sizes(1, kp)[plane]
    return _encode_tmap("UINT8", ptr + offset, [row_bytes, TILE_ROWS, rows // TILE_ROWS], [row_bytes, tile],
                        [box_bytes, box_rows, 1], swizzle)


class Launch:
    """One kernel launch with its arguments packed once: calling it only issues the launch.

    With pdl (a kernel that calls nf_pdl_enter(), on sm_90+) the launch allows programmatic stream
    serialization: the kernel may be scheduled while the previous one in the stream still runs, and waits
    for it inside (codegen/templates/_pdl.cuh.j2). Holds no tensors: the caller keeps the buffers alive (and
    fixed, when the launch is graph-captured)."""

    def __init__(self, module: Module, grid, block, smem: int, values: list, pdl: bool = False):
        self.function, self.grid, self.block, self.smem = module.function, grid, block, smem
        self._values = values  # ctypes objects; their addresses are what the kernel reads
        self._params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        self._params_addr = ctypes.addressof(self._params)
        self._config = _pdl_config(grid, block, smem) if pdl else None

    def __call__(self, stream_handle: int | None = None) -> None:
        from cuda.bindings import driver
        if stream_handle is None:
            import torch
            stream_handle = torch.cuda.current_stream().cuda_stream
        if self._config is not None:
            self._config.hStream = _stream(stream_handle)
            err, = driver.cuLaunchKernelEx(self._config, self.function, self._params_addr, 0)
        else:
            err, = driver.cuLaunchKernel(self.function, *self.grid, *self.block, self.smem, _stream(stream_handle),
                                         self._params_addr, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            check((err,), "cuLaunchKernelEx" if self._config is not None else "cuLaunchKernel")


def _pdl_config(grid, block, smem: int):
    from cuda.bindings import driver
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = smem
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg
