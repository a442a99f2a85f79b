"""Shared machinery of the weight formats: typed errors, the `Format` interface and the row-tiled
layout `rowtile128-v1` that every packed format uses (byte layout: specs/formats.md).

Shapes are row-major, last axis fastest. A tensor of shape [..., K] is treated as a matrix
[N, K] with N = prod(leading dims) (N = 1 for rank 0/1). Packed formats cut that matrix into tiles
of 128 rows; a tile is self-contained (its code, high-bit and scale planes sit together), so a
converter can encode and append tile after tile with bounded memory and a GEMV/GEMM CTA that owns a
128-row block reads one contiguous span.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

TILE_ROWS = 128     # rows per tile; also the fp8_b128 block height and a common GEMM BN tile
K_ALIGN = 128       # K is zero-padded to a multiple of this (keeps every row 16-byte-load aligned)
PLANE_ALIGN = 256   # each plane inside a tile (and each tile) starts 256-byte aligned


class FormatError(ValueError):
    """A tensor cannot be encoded or decoded in a format. Messages name the tensor."""


class NonFiniteError(FormatError):
    """The source tensor holds NaN or +-inf."""


class ScaleOverflowError(FormatError):
    """A group's scale does not fit the scale type (e.g. > 65504 for FP16 scales)."""


class FormatShapeError(FormatError):
    """The shape is not admitted by the format (e.g. rank 1 for a packed format)."""


class UnknownFormatError(FormatError):
    """No format of that name."""


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def as_matrix_shape(shape) -> tuple[int, int]:
    """[..., K] -> (N, K) with N = prod(leading dims); rank 0 is one element."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        return 1, 1
    return (math.prod(shape[:-1]) if len(shape) > 1 else 1), shape[-1]


def check_finite(x: np.ndarray, name: str, row0: int = 0) -> None:
    if x.size and not np.isfinite(x).all():
        idx = [int(i) for i in np.argwhere(~np.isfinite(x))[0]]
        value = x[tuple(idx)]
        if len(idx) >= 1:
            idx[0] += row0
        raise NonFiniteError(f"tensor {name!r}: non-finite value {value} at row-major index {idx}; "
                             f"weights must be finite")


class TileStack(NamedTuple):
    """Consecutive equal tiles of a packed object: all the full 128-row tiles, or the short last one."""
    pos: int              # byte offset of its first tile in the object (after the header)
    row0: int             # its first row
    tiles: int
    rows: int             # rows per tile
    offsets: list         # plane offsets inside a tile
    sizes: list           # plane sizes
    tile_bytes: int

    def planes(self, buf):
        """This stack's planes in the object's bytes `buf` (1-D numpy array or torch tensor): one
        [tiles, size] view per plane."""
        tiles = buf[self.pos:self.pos + self.tiles * self.tile_bytes].reshape(self.tiles, self.tile_bytes)
        return [tiles[:, o:o + size] for o, size in zip(self.offsets, self.sizes)]


class Format:
    """One numeric format + its byte layout. Subclasses are stateless singletons."""
    name: str = ""
    layout: str = ""
    min_rank: int = 0
    row_block: int = 1          # encode_rows() wants row counts that are multiples of this (but the last)
    needs_amax: bool = False    # encode_rows() needs the whole tensor's max|x| (one extra read pass)
    itemsize: int = 0           # direct formats only
    is_float_exact = False      # True for formats that never lose information from a BF16 source

    def check_shape(self, shape, name: str = "tensor") -> None:
        if len(shape) < self.min_rank or any(int(d) <= 0 for d in shape):
            raise FormatShapeError(f"tensor {name!r}: shape {list(shape)} is not admitted by format "
                                   f"{self.name} (needs rank >= {self.min_rank}, positive dims)")

    def nbytes(self, shape) -> int:
        raise NotImplementedError

    def header(self, shape, amax: float | None = None) -> np.ndarray:
        """Bytes that precede the rows (only formats with a per-tensor parameter have any)."""
        return np.zeros(0, np.uint8)

    def encode_rows(self, rows: np.ndarray, name: str = "tensor", row0: int = 0,
                    amax: float | None = None) -> np.ndarray:
        """Encode a [r, K] float32 block of consecutive rows -> uint8 bytes of those rows."""
        raise NotImplementedError

    def encode(self, x: np.ndarray, name: str = "tensor") -> np.ndarray:
        """Encode a whole tensor -> uint8 array of exactly nbytes(x.shape) bytes."""
        x = np.asarray(x)
        self.check_shape(x.shape, name)
        n, k = as_matrix_shape(x.shape)
        rows = x.reshape(n, k)
        amax = None
        if self.needs_amax:
            check_finite(rows.astype(np.float32, copy=False), name)
            amax = float(np.abs(rows).max()) if rows.size else 0.0
        out = np.concatenate([self.header(x.shape, amax), self.encode_rows(rows, name, 0, amax)])
        assert out.size == self.nbytes(x.shape), (self.name, out.size, self.nbytes(x.shape))
        return out

    def decode(self, buf, shape) -> np.ndarray:
        """Bytes -> float32 array of `shape` (the format's exact reconstruction)."""
        raise NotImplementedError

    def error_bound(self, x: np.ndarray) -> np.ndarray:
        """Per-element bound on |decode(encode(x)) - x|, derived from x alone (not from the encoder's
        output), so a test that checks it also catches a wrong scale."""
        raise NotImplementedError

    def bits_per_weight(self, shape) -> float:
        n = math.prod(int(d) for d in shape) if shape else 1
        return 8.0 * self.nbytes(shape) / n


class TiledFormat(Format):
    """Row-tiled packed layout `rowtile128-v1`. A subclass describes the planes of one tile of r rows
    (r <= 128) and how to encode/decode a stack of equal tiles; this class does padding, tiling and
    assembly. Tile t of an [N, K] tensor starts at header_bytes + t * full_tile_bytes."""
    layout = "rowtile128-v1"
    min_rank = 2
    row_block = TILE_ROWS
    header_bytes = 0

    # -- per-format hooks ---------------------------------------------------------------------
    def plane_sizes(self, r: int, kp: int) -> list[int]:
        raise NotImplementedError

    def encode_tiles(self, x: np.ndarray, name: str, row0: int, amax) -> list[np.ndarray]:
        """x: [nt, r, kp] float32 -> one uint8 array [nt, plane_size] per plane."""
        raise NotImplementedError

    def decode_tiles(self, planes: list[np.ndarray], r: int, kp: int, header: np.ndarray) -> np.ndarray:
        """Inverse of encode_tiles: planes [nt, size] -> [nt, r, kp] float32."""
        raise NotImplementedError

    # -- layout arithmetic --------------------------------------------------------------------
    def tile_layout(self, r: int, kp: int) -> tuple[list[int], int]:
        """Plane offsets inside a tile of r rows, and the tile's size (256-aligned)."""
        offsets, pos = [], 0
        for size in self.plane_sizes(r, kp):
            offsets.append(pos)
            pos = align_up(pos + size, PLANE_ALIGN)
        return offsets, pos

    def tile_stacks(self, n: int, kp: int):
        """The tiles of n rows of kp lanes, in byte order: at most two stacks of equal tiles."""
        pos, full = self.header_bytes, n // TILE_ROWS * TILE_ROWS
        for start, stop in ((0, full), (full, n)):
            if stop > start:
                r = min(TILE_ROWS, stop - start)
                offsets, size = self.tile_layout(r, kp)
                stack = TileStack(pos, start, (stop - start) // r, r, offsets, self.plane_sizes(r, kp), size)
                pos += stack.tiles * size
                yield stack

    def nbytes(self, shape) -> int:
        self.check_shape(shape)
        n, k = as_matrix_shape(shape)
        kp = align_up(k, K_ALIGN)
        full, rest = divmod(n, TILE_ROWS)
        total = self.header_bytes + full * self.tile_layout(TILE_ROWS, kp)[1]
        if rest:
            total += self.tile_layout(rest, kp)[1]
        return total

    # -- encode / decode ----------------------------------------------------------------------
    def encode_rows(self, rows, name="tensor", row0=0, amax=None) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.float32)
        check_finite(rows, name, row0)
        n, k = rows.shape
        kp = align_up(k, K_ALIGN)
        if kp != k:   # pad lanes are zeros -> code 0; wholly padded groups get scale +0
            padded = np.zeros((n, kp), np.float32)
            padded[:, :k] = rows
            rows = padded
        parts = []
        for st in self.tile_stacks(n, kp):
            x = rows[st.row0:st.row0 + st.tiles * st.rows].reshape(st.tiles, st.rows, kp)
            out = np.zeros(st.tiles * st.tile_bytes, np.uint8)
            for view, plane in zip(TileStack(0, *st[1:]).planes(out), self.encode_tiles(x, name, row0 + st.row0, amax)):
                view[:] = plane
            parts.append(out)
        return np.concatenate(parts) if parts else np.zeros(0, np.uint8)

    def decode(self, buf, shape) -> np.ndarray:
        buf = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1)
        if buf.size != self.nbytes(shape):
            raise FormatError(f"format {self.name}: {buf.size} bytes given, shape {list(shape)} "
                              f"needs {self.nbytes(shape)}")
        n, k = as_matrix_shape(shape)
        kp = align_up(k, K_ALIGN)
        header = buf[:self.header_bytes]
        out = [self.decode_tiles(st.planes(buf), st.rows, kp, header).reshape(st.tiles * st.rows, kp)
               for st in self.tile_stacks(n, kp)]
        return np.concatenate(out)[:, :k].reshape(shape).astype(np.float32, copy=False)

    @staticmethod
    def padded_groups(x: np.ndarray, group: int) -> np.ndarray:
        """[..., K] -> [N, kp/group, group] float32 with zero pad lanes (for error bounds)."""
        n, k = as_matrix_shape(x.shape)
        kp = align_up(k, K_ALIGN)
        g = np.zeros((n, kp), np.float32)
        g[:, :k] = np.asarray(x, np.float32).reshape(n, k)
        return g.reshape(n, kp // group, group)

    @staticmethod
    def ungroup(bound: np.ndarray, shape) -> np.ndarray:
        n, k = as_matrix_shape(shape)
        return bound.reshape(n, -1)[:, :k].reshape(shape)
