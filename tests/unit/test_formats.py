"""Weight formats: bit-exact agreement with an independent scalar reference of the byte layout
(specs/formats.md), round trips on edge cases, error bounds, and typed errors."""
import math
import struct

import numpy as np
import pytest
import torch

from ninfer.runtime import formats as F
from ninfer.runtime.format_base import FormatShapeError, NonFiniteError, ScaleOverflowError, UnknownFormatError
from ninfer.runtime.format_fp8 import E4M3_VALUES, e2m1_encode, e4m3_encode

torch.set_num_threads(1)
INT_FORMATS = {"q4": (4, 64), "q5": (5, 64), "q6": (6, 64), "w8": (8, 32)}
PACKED = ["q4", "q5", "q6", "w8", "fp8", "fp8_b128", "nvfp4"]


# ---------------------------------------------------------------- scalar reference (slow, obvious)
def _pad256(b: bytearray) -> bytearray:
    return b + bytes(-len(b) % 256)


def _f16_bits(x: float) -> int:
    return struct.unpack("<H", struct.pack("<e", x))[0]       # struct rounds half to even


def _f16_value(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits))[0]


def ref_int_bytes(x: np.ndarray, bits: int, group: int) -> bytes:
    qmax = 127 if bits == 8 else 2 ** (bits - 1) - 1
    qmin = -127 if bits == 8 else -(2 ** (bits - 1))
    n, k = x.shape
    kp = -(-k // 128) * 128
    out = bytearray()
    for t0 in range(0, n, 128):
        base, high, scales = bytearray(), bytearray(), bytearray()
        for i in range(t0, min(n, t0 + 128)):
            row = [np.float32(v) for v in x[i]] + [np.float32(0)] * (kp - k)
            codes = []
            for g in range(kp // group):
                grp = row[g * group:(g + 1) * group]
                amax = max(abs(v) for v in grp)
                sbits = 0
                if amax > 0:
                    sbits = _f16_bits(float(np.float32(amax / np.float32(qmax)))) or 1
                s = np.float32(_f16_value(sbits))
                inv = np.float32(1) / s if sbits else np.float32(0)
                codes += [max(qmin, min(qmax, round(float(np.float32(v * inv))))) for v in grp]
                scales += struct.pack("<H", sbits)
            if bits == 8:
                base += bytes(c & 0xFF for c in codes)
            else:
                base += bytes((codes[j] & 0xF) | ((codes[j + 1] & 0xF) << 4) for j in range(0, kp, 2))
                hb = bits - 4
                for j in range(0, kp, 8 // hb if hb else kp):
                    if hb:
                        high.append(sum(((codes[j + l] >> 4) & ((1 << hb) - 1)) << (hb * l)
                                        for l in range(8 // hb)))
        tile = _pad256(base) + (_pad256(high) if high else b"") + _pad256(scales)
        out += tile
    return bytes(out)


_E4M3_POS = [(float(E4M3_VALUES[c]), c) for c in range(0x7F)]   # 0..448, codes 0..126


def ref_e4m3(v: float, ceil: bool = False) -> int:
    """Nearest E4M3 by exhaustive search; ties to the even code; ceil: smallest value >= |v|."""
    a = abs(v)
    if ceil:
        code = min(c for val, c in _E4M3_POS if val >= a)
    else:
        best = min(abs(val - a) for val, _ in _E4M3_POS)
        cands = [c for val, c in _E4M3_POS if abs(val - a) == best]
        code = cands[0] if len(cands) == 1 else next(c for c in cands if c % 2 == 0)
    return code | (0x80 if v < 0 and code else 0)


def ref_e2m1(v: float) -> int:
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    a = abs(v)
    best = min(abs(g - a) for g in grid)
    cands = [i for i, g in enumerate(grid) if abs(g - a) == best]
    i = cands[0] if len(cands) == 1 else next(c for c in cands if c % 2 == 0)
    return i | (8 if v < 0 and i else 0)


def ref_fp8_bytes(x: np.ndarray, block) -> bytes:
    n, k = x.shape
    kp = -(-k // 128) * 128
    xp = np.zeros((n, kp), np.float32)
    xp[:, :k] = x
    out = bytearray()
    for t0 in range(0, n, 128):
        rows = xp[t0:t0 + 128]
        if block is None:
            scales = []
            for r in rows:
                amax = float(np.abs(r).max())
                scales.append(max(np.float32(np.float32(amax) / np.float32(448)), np.float32(2.0 ** -100))
                              if amax else np.float32(0))
            inv_of = lambda i, j: np.float32(1) / scales[i] if scales[i] else np.float32(0)  # noqa: E731
        else:
            scales = []
            for b in range(kp // 128):
                amax = float(np.abs(rows[:, b * 128:(b + 1) * 128]).max())
                scales.append(max(np.float32(np.float32(amax) / np.float32(448)), np.float32(2.0 ** -100))
                              if amax else np.float32(0))
            inv_of = lambda i, j: np.float32(1) / scales[j // 128] if scales[j // 128] else np.float32(0)  # noqa
        codes = bytes(ref_e4m3(float(min(448.0, max(-448.0, np.float32(rows[i, j] * inv_of(i, j))))))
                      for i in range(len(rows)) for j in range(kp))
        out += _pad256(bytearray(codes)) + _pad256(bytearray(b"".join(struct.pack("<f", s) for s in scales)))
    return bytes(out)


def ref_nvfp4_bytes(x: np.ndarray) -> bytes:
    n, k = x.shape
    kp = -(-k // 128) * 128
    xp = np.zeros((n, kp), np.float32)
    xp[:, :k] = x
    amax_t = float(np.abs(x).max())
    sg = max(np.float32(np.float32(amax_t) / np.float32(6 * 448)), np.float32(2.0 ** -100)) if amax_t else np.float32(1)
    out = bytearray(struct.pack("<f", sg)) + bytes(252)
    d = np.float32(6 * sg)
    for t0 in range(0, n, 128):
        codes, scales = [], bytearray()
        for r in xp[t0:t0 + 128]:
            for b in range(kp // 16):
                blk = r[b * 16:(b + 1) * 16]
                q = np.float32(np.float32(np.abs(blk).max()) / d)
                sb = ref_e4m3(float(min(q, np.float32(448))), ceil=True)
                scales.append(sb)
                eff = np.float32(np.float32(E4M3_VALUES[sb]) * sg)
                inv = np.float32(1) / eff if eff else np.float32(0)
                codes += [ref_e2m1(float(min(6.0, max(-6.0, np.float32(v * inv))))) for v in blk]
        packed = bytes(codes[j] | (codes[j + 1] << 4) for j in range(0, len(codes), 2))
        out += _pad256(bytearray(packed)) + _pad256(scales)
    return bytes(out)


def edge_matrix(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random weights plus the awkward cases: an all-zero row (zero groups), rows whose scales are
    FP16 subnormals or underflow to 0 (-> 0x0001), exact ties, and K not a multiple of 128."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    x[0] = 0.0
    x[1] *= np.float32(1e-4)                       # scales ~ 1e-6/qmax: FP16 subnormals
    x[2] = (rng.standard_normal(k) * 1e-9).astype(np.float32)   # amax/qmax < 2**-25: scale 0x0001
    x[3, :min(k, 64)] = np.float32(0.5) * np.arange(min(k, 64)) % 7 - 3   # multiples of 0.5: ties
    x[4, 5] = np.float32(-0.0)
    return x


# ---------------------------------------------------------------- bit-exact layout
@pytest.mark.parametrize("name", list(INT_FORMATS))
@pytest.mark.parametrize("shape", [(5, 100), (130, 200), (128, 64), (2, 3, 136)])
def test_int_formats_match_scalar_reference(name, shape):
    bits, group = INT_FORMATS[name]
    x = edge_matrix(math.prod(shape[:-1]), shape[-1]).reshape(shape)
    got = F.encode(name, x, "t").tobytes()
    assert len(got) == F.nbytes(name, shape)
    assert got == ref_int_bytes(x.reshape(-1, shape[-1]), bits, group)


@pytest.mark.parametrize("name,block", [("fp8", None), ("fp8_b128", 128)])
def test_fp8_matches_scalar_reference(name, block):
    x = edge_matrix(131, 150, seed=3)
    x[7, :16] = np.float32(448.0) * x[7, :16] / np.abs(x[7, :16]).max()
    got = F.encode(name, x, "t").tobytes()
    assert got == ref_fp8_bytes(x, block)


def test_nvfp4_matches_scalar_reference():
    x = edge_matrix(130, 96, seed=4)
    got = F.encode("nvfp4", x, "t").tobytes()
    assert len(got) == F.nbytes("nvfp4", x.shape)
    assert got == ref_nvfp4_bytes(x)


def test_direct_formats_layout():
    x = np.array([[1.0, -2.5, 3.0e-39], [0.1, 65504.0, -0.0]], np.float32)
    assert F.encode("fp32", x).tobytes() == x.astype("<f4").tobytes()
    ref_bf16 = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    assert F.encode("bf16", x).tobytes() == ref_bf16
    ints = np.array([[0, -1], [2**31 - 1, -2**31]], np.int32)
    assert F.encode("i32", ints).tobytes() == ints.astype("<i4").tobytes()
    assert F.I32.decode_int(F.encode("i32", ints).tobytes(), ints.shape).tolist() == ints.tolist()


# ---------------------------------------------------------------- minifloat rounding
def test_e4m3_rne_matches_torch_cast():
    vals = E4M3_VALUES[np.isfinite(E4M3_VALUES)].astype(np.float64)
    pos = np.unique(np.abs(vals))
    mids = (pos[1:] + pos[:-1]) / 2                       # exact ties
    rng = np.random.default_rng(0)
    x = np.concatenate([vals, mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9),
                        rng.uniform(-448, 448, 20000), rng.standard_normal(20000) * 1e-3]).astype(np.float32)
    x = x[np.abs(x) <= 448]
    ours = e4m3_encode(x)
    theirs = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    neg_zero = theirs == 0x80          # torch keeps -0; the format canonicalises zero to 0x00
    assert (ours[neg_zero] == 0).all()
    assert np.array_equal(ours[~neg_zero], theirs[~neg_zero])


def test_e4m3_ceil_and_e2m1_match_exhaustive_search():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(0, 448, 3000), rng.uniform(0, 2 ** -6, 500), E4M3_VALUES[:0x7F]]).astype(np.float32)
    assert [int(c) for c in e4m3_encode(x, mode="ceil")] == [ref_e4m3(float(v), ceil=True) for v in x]
    grid = np.array([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6], np.float32)
    y = np.concatenate([grid, -grid, rng.uniform(-6, 6, 3000).astype(np.float32)])
    assert [int(c) for c in e2m1_encode(y)] == [ref_e2m1(float(v)) for v in y]


# ---------------------------------------------------------------- round trips and bounds
@pytest.mark.parametrize("name", ["fp32", "bf16"] + PACKED)
@pytest.mark.parametrize("shape", [(3, 100), (130, 300), (256, 256), (2, 5, 70)])
def test_decode_within_error_bound(name, shape):
    rng = np.random.default_rng(hash((name, shape)) % 2**32)
    x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    x.reshape(-1)[:: 97] *= 30.0                   # outliers stretch some groups' scales
    fmt = F.get_format(name)
    y = fmt.decode(fmt.encode(x, "t"), shape)
    bound = fmt.error_bound(x)
    assert y.shape == shape and y.dtype == np.float32
    assert (np.abs(y.astype(np.float64) - x) <= bound).all()
    if name not in ("fp32",):
        assert bound.max() > 0                    # the bound is a real constraint, not a blank cheque
        assert (np.abs(y - x) > 0).any()


@pytest.mark.parametrize("name", list(INT_FORMATS))
def test_int_edge_cases_decode_exactly(name):
    bits, group = INT_FORMATS[name]
    qmax = 127 if bits == 8 else 2 ** (bits - 1) - 1
    x = edge_matrix(6, 200)
    y = F.decode(name, F.encode(name, x, "t"), x.shape)
    assert (y[0] == 0).all()                                       # zero groups stay zero
    tiny = F.get_format(name)
    g = tiny.padded_groups(x, group)
    s = np.array([_f16_value(_f16_bits(float(np.float32(a / np.float32(qmax)))) or 1) if a else 0.0
                  for a in np.abs(g).max(-1).ravel()]).reshape(g.shape[:2])
    # decoded values are exactly scale * integer code, codes within range, pad lanes 0
    codes = np.divide(tiny.padded_groups(y, group), s[..., None], out=np.zeros(g.shape), where=s[..., None] > 0)
    assert np.array_equal(codes, np.rint(codes))
    assert codes.min() >= (-127 if bits == 8 else -qmax - 1) and codes.max() <= qmax
    assert (np.abs(y - x) <= tiny.error_bound(x)).all()
    # row 2: scale underflowed -> 0x0001 (2**-24), so nonzero weights are not all flushed to 0
    real_groups = -(-200 // group)               # the rest are wholly padding: scale +0
    assert (s[2, :real_groups] == 2.0 ** -24).all() and (s[2, real_groups:] == 0).all()


@pytest.mark.parametrize("name", list(INT_FORMATS))
def test_int_max_magnitude_and_overflow(name):
    bits, group = INT_FORMATS[name]
    qmax = 127 if bits == 8 else 2 ** (bits - 1) - 1
    x = np.zeros((1, group), np.float32)
    x[0, 0], x[0, 1] = 65504.0 * qmax, -65504.0 * qmax          # largest representable scale
    y = F.decode(name, F.encode(name, x, "t"), x.shape)
    assert y[0, 0] == 65504.0 * qmax and y[0, 1] == -65504.0 * qmax
    x[0, 0] = 65520.0 * qmax                                     # scale rounds to inf
    with pytest.raises(ScaleOverflowError, match="big_w.*65504"):
        F.encode(name, x, "big_w")


def test_w8_never_emits_minus_128():
    x = np.full((1, 32), -1.0, np.float32)
    x[0, 0] = 1.0
    raw = F.encode("w8", x)
    assert (raw[:32].view(np.int8) == -127).sum() == 31


def test_padding_lanes_and_partial_tiles():
    """K=130 pads to 256: lanes 130..255 are code 0 and the wholly padded group's scale is +0;
    N=129 is one full tile plus a 1-row tile."""
    x = np.full((129, 130), 0.875, np.float32)     # 7 * 0.125: scale and codes exact
    raw = F.encode("q4", x)
    fmt = F.get_format("q4")
    offs, full = fmt.tile_layout(128, 256)
    assert raw.size == full + fmt.tile_layout(1, 256)[1]
    codes = raw[:128 * 128].reshape(128, 128)
    assert (codes[:, 65:] == 0).all()                            # lanes 130.. (bytes 65..) are zero
    scales = raw[offs[1]:offs[1] + 128 * 4 * 2].view("<f2").reshape(128, 4)
    assert (scales[:, 3] == 0).all() and (scales[:, 2] > 0).all()
    assert np.array_equal(F.decode("q4", raw, x.shape), x)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("name", ["fp32", "bf16"] + PACKED)
def test_non_finite_input_is_rejected_with_tensor_name(name):
    x = np.zeros((4, 64), np.float32)
    x[2, 7] = np.nan
    with pytest.raises(NonFiniteError, match=r"layers\.9\.mlp\.down.*\[2, 7\]"):
        F.encode(name, x, "layers.9.mlp.down")
    x[2, 7] = np.inf
    with pytest.raises(NonFiniteError):
        F.encode(name, x, "w")


def test_shape_and_name_errors():
    with pytest.raises(FormatShapeError, match="norm.*q4"):
        F.encode("q4", np.ones(64, np.float32), "norm")
    with pytest.raises(UnknownFormatError, match="int3.*known"):
        F.get_format("int3")
    with pytest.raises(F.FormatError, match="bytes given"):
        F.decode("q4", b"\0" * 10, (4, 64))


def test_nbytes_bits_per_weight():
    shape = (34816, 5120)       # Qwen3.6-27B mlp gate_up
    assert F.get_format("q4").bits_per_weight(shape) == 4.25
    assert F.get_format("q5").bits_per_weight(shape) == 5.25
    assert F.get_format("q6").bits_per_weight(shape) == 6.25
    assert F.get_format("w8").bits_per_weight(shape) == 8.5
    assert F.get_format("fp8_b128").bits_per_weight(shape) > 8.0
    assert F.get_format("nvfp4").bits_per_weight(shape) == pytest.approx(4.5, abs=1e-3)
