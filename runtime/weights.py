"""Model weights in memory: direct formats as tensors of the run dtype, linear weights in a packed format
(q4/q5/q6/w8/fp8, specs/formats.md §3) kept packed as `PackedWeight`, which the model's linear and expert
calls hand to the packed ops (linear_<fmt>, moe_experts_<fmt>) that dequantize on the fly."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .draft_head import DRAFT_HEAD, DRAFT_IDS, draft_ids
from .format_base import K_ALIGN, TILE_ROWS, TiledFormat, align_up, as_matrix_shape
from .formats import get_format
from .reference_quant import PACKED

KEEP_FP32 = ("gdn_A_log", "gdn_dt_bias")  # contract dtype f32 whatever the run dtype
DECODED_ROLES = ("embed",)                # read by the embedding op, which takes a float table


@dataclass(frozen=True)
class PackedWeight:
    """A weight of logical `shape` ([..., K], viewed as the matrix [N, K]) stored as its packed bytes."""
    data: torch.Tensor      # uint8 [nbytes(fmt, shape)]
    fmt: str
    shape: tuple

    def __post_init__(self):
        if self.fmt not in PACKED:
            raise ValueError(f"no kernels read format {self.fmt!r} packed (packed formats: {', '.join(PACKED)})")
        if self.data.dtype != torch.uint8 or self.data.numel() != get_format(self.fmt).nbytes(self.shape):
            raise ValueError(f"{self.fmt} {list(self.shape)}: expected {get_format(self.fmt).nbytes(self.shape)} "
                             f"uint8 bytes, got {self.data.numel()} {self.data.dtype}")

    @property
    def matrix(self) -> tuple[int, int]:
        return as_matrix_shape(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def can_cat_rows(fmt_a: str, shape_a, fmt_b: str, shape_b) -> bool:
    """Whether two stored matrices join as [a; b] by appending b's storage to a's: one format, one width,
    and for a packed format no object header and a ending on a whole 128-row tile (b's tiles then follow)."""
    if fmt_a != fmt_b or len(shape_a) != 2 or len(shape_b) != 2 or shape_a[1] != shape_b[1]:
        return False
    if fmt_a not in PACKED:
        return True
    fmt = get_format(fmt_a)
    return isinstance(fmt, TiledFormat) and not fmt.header_bytes and shape_a[0] % TILE_ROWS == 0


def cat_rows(a, b):
    """The matrix [a; b] (a's rows, then b's) as loaded weights (PackedWeight or tensor), or None where
    can_cat_rows says no."""
    if isinstance(a, PackedWeight) and isinstance(b, PackedWeight):
        if not can_cat_rows(a.fmt, a.matrix, b.fmt, b.matrix):
            return None
        return PackedWeight(torch.cat([a.data, b.data]), a.fmt, (a.matrix[0] + b.matrix[0], a.matrix[1]))
    if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.dim() == b.dim() == 2
            and a.shape[1] == b.shape[1]):
        return torch.cat([a, b])
    return None


def split_rows(w, n: int):
    """The rows [0, n) and [n, N) of a loaded matrix as two views of its storage (cat_rows undone), or None where
    they are not contiguous pieces of it (a packed matrix split inside a 128-row tile)."""
    if isinstance(w, PackedWeight):
        rows, k = w.matrix
        if not 0 < n < rows or not can_cat_rows(w.fmt, (n, k), w.fmt, (rows - n, k)):
            return None
        cut = get_format(w.fmt).nbytes((n, k))
        if cut % 16:   # kernels take 16-byte aligned operands
            return None
        return PackedWeight(w.data[:cut], w.fmt, (n, k)), PackedWeight(w.data[cut:], w.fmt, (rows - n, k))
    ok = w.dim() == 2 and 0 < n < w.shape[0] and (n * w.stride(0) * w.element_size()) % 16 == 0
    return (w[:n], w[n:]) if ok else None


def load_weights(art, device, dtype: torch.dtype, packed: bool = True, mtp: bool = False, draft_head: bool = False) -> dict:
    """Every text-model tensor on `device` (and the MTP layer's, with `mtp`; its draft head, lm_head_draft, only with
    `draft_head` too: the shortlist of draft_vocab_size, with its ids as DRAFT_IDS), copied in chunks from the mapping:
    direct formats cast to the run dtype, packed linear weights kept packed (with `packed`), other packed tensors
    (the embedding table, formats no kernel reads packed, everything without `packed`) decoded exactly and cast. A
    tied lm_head reads the packed table too."""
    out = {}
    skip = {"visual"} | (set() if mtp else {"mtp"})
    for name, entry in art.tensors.items():
        if set(entry.flags) & skip or (name == DRAFT_HEAD and not draft_head):
            continue
        want = torch.float32 if entry.role in KEEP_FP32 else dtype
        if entry.format in ("bf16", "fp32"):
            out[name] = art.to_device(name, device).to(want).contiguous()
            continue
        if packed and entry.format in PACKED:
            pw = PackedWeight(art.to_device(name, device), entry.format, tuple(entry.shape))
            if entry.role not in DECODED_ROLES:
                out[name] = pw
                continue
            out[name + ".packed"] = pw
        out[name] = torch.from_numpy(art.decode(name)).to(device).to(want).contiguous()
    if DRAFT_HEAD in out:
        out[DRAFT_IDS] = torch.tensor(draft_ids(art), dtype=torch.int32, device=device)
    return out


def random_packed(fmt: str, shape, device, generator: torch.Generator, std: float) -> PackedWeight:
    """Random bytes in a valid packed layout, made on the device (encoding real-shape random floats on
    the host would take minutes): uniform codes, scales so that code·scale has about `std` deviation,
    pad lanes zero-coded as the encoder writes them."""
    f = get_format(fmt)
    n, k = as_matrix_shape(shape)
    data = torch.randint(0, 256, (f.nbytes(shape),), dtype=torch.uint8, device=device, generator=generator)
    if fmt == "w8":
        data[data == 0x80] = 0x81                                  # -128 is not a legal w8 code
    if fmt == "fp8":
        data[(data & 0x7F) == 0x7F] = 0x00                         # E4M3 NaN patterns are never written
    kp = align_up(k, K_ALIGN)
    for st in f.tile_stacks(n, kp):
        planes = st.planes(data)
        if kp != k:                                                 # pad lanes: code 0
            for plane in planes[:1 + (fmt in ("q5", "q6"))]:        # codes, and the high bits of q5/q6
                lanes = plane.view(st.tiles, st.rows, -1)
                lanes[:, :, math.ceil(k * lanes.shape[-1] / kp):] = 0
        scales = planes[-1]
        if fmt == "fp8":      # E4M3 codes are ~uniform in magnitude up to 448: scale to std
            s = torch.full((st.tiles, scales.shape[1] // 4), std / 100.0, dtype=torch.float32, device=device)
        else:                 # uniform integer codes in [-qmax, qmax] have deviation ~qmax / sqrt(3)
            s = torch.full((st.tiles, scales.shape[1] // 2), std * math.sqrt(3) / f.qmax, dtype=torch.float16,
                           device=device)
        scales[:] = s.view(torch.uint8).view(st.tiles, -1)
    return PackedWeight(data, fmt, tuple(shape))


def weights_nbytes(weights: dict) -> int:
    """Device bytes the loaded weights hold (packed ones at their packed size)."""
    return sum(w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size() for w in weights.values())

