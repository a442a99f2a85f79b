""".ninfer container: round trip, alignment, zero-copy views, atomic streaming writes, and one typed
error per kind of damage (each naming the object)."""
import hashlib
import json
import os
import struct

import numpy as np
import pytest
import torch

from ninfer.runtime import artifact as A
from ninfer.runtime import formats as F

torch.set_num_threads(1)
RNG = np.random.default_rng(7)
TENSORS = {
    "embed": ((300, 200), "q4", "embed", ()),
    "layers.0.mlp.gate_up": ((2, 128, 96), "w8", "experts_gate_up", ()),
    "norm": ((200,), "fp32", "norm", ()),
    "conv": ((16, 4), "bf16", "conv", ()),
    "mtp.fc": ((64, 128), "nvfp4", "mtp_fc", ("mtp",)),
    "ids": ((5,), "i32", "draft_ids", ()),
}
RESOURCES = {"tokenizer.json": '{"vocab": "ünï 思"}\r\n'.encode(), "chat_template.jinja": b"", "config.json": b"{}"}


def _data(name, shape, fmt):
    if fmt == "i32":
        return np.arange(np.prod(shape), dtype=np.int32).reshape(shape) - 2
    return (RNG.standard_normal(shape) * 0.05).astype(np.float32)


DATA = {n: _data(n, s, f) for n, (s, f, _, _) in TENSORS.items()}


def write(path, chunk_rows=64, fail_at=None):
    specs = [A.TensorSpec(n, s, f, r, fl) for n, (s, f, r, fl) in TENSORS.items()]
    with A.ArtifactWriter(path, "qwen3_5", specs, [(n, len(b)) for n, b in RESOURCES.items()]) as w:
        for n, (shape, fmt, _, _) in TENSORS.items():
            w.add_tensor(n, _chunks(n, shape, fmt, chunk_rows, fail_at))
        for n, b in RESOURCES.items():
            w.add_resource(n, b)
    return path


def _chunks(name, shape, fmt, chunk_rows, fail_at):
    f = F.get_format(fmt)
    x = DATA[name].reshape(-1, shape[-1])
    amax = float(np.abs(x).max())
    if f.needs_amax:
        yield f.header(shape, amax)
    step = max(f.row_block, chunk_rows // f.row_block * f.row_block)
    for r0 in range(0, x.shape[0], step):
        if name == fail_at and r0 > 0:
            raise RuntimeError("source went away mid-tensor")
        yield f.encode_rows(x[r0:r0 + step], name, r0, amax)


@pytest.fixture
def art_path(tmp_path):
    return write(tmp_path / "m.ninfer")


def rewrite_directory(path, mutate):
    """Apply `mutate` to the JSON directory, keep the payload bytes (moved to the new offset)."""
    raw = path.read_bytes()
    magic, n = struct.unpack("<8sQ", raw[:16])
    old_off = -(-(16 + n) // 4096) * 4096
    doc = json.loads(raw[16:16 + n])
    mutate(doc)
    js = json.dumps(doc).encode()
    new_off = -(-(16 + len(js)) // 4096) * 4096
    path.write_bytes(struct.pack("<8sQ", magic, len(js)) + js + bytes(new_off - 16 - len(js)) + raw[old_off:])


# ---------------------------------------------------------------- round trip
def test_round_trip_alignment_and_values(art_path):
    with A.open_artifact(art_path) as a:
        assert a.model_family == "qwen3_5" and a.format_version == 2
        assert a.payload_offset % 4096 == 0
        assert a.file_size == os.path.getsize(art_path) and a.file_size % 4096 == 0
        for n, (shape, fmt, role, flags) in TENSORS.items():
            t = a.tensors[n]
            assert (t.shape, t.format, t.role, t.flags) == (shape, fmt, role, flags)
            assert t.offset % 4096 == 0 and t.bytes == F.nbytes(fmt, shape)
            assert t.layout == F.get_format(fmt).layout
            y = a.decode(n)
            assert (np.abs(y - DATA[n]) <= F.get_format(fmt).error_bound(DATA[n])).all()
            assert hashlib.sha256(a.raw(n).tobytes()).hexdigest() == t.sha256
        assert np.array_equal(a.array("norm"), DATA["norm"])
        assert np.array_equal(a.array("ids"), DATA["ids"])
        for n, b in RESOURCES.items():
            assert a.resource(n) == b
            assert a.resources[n].offset % 4096 == 0
        a.verify()


def test_chunking_does_not_change_bytes(tmp_path):
    a1 = write(tmp_path / "a.ninfer", chunk_rows=128).read_bytes()
    a2 = write(tmp_path / "b.ninfer", chunk_rows=100000).read_bytes()
    assert a1 == a2


def test_views_are_zero_copy_and_read_only(art_path):
    with A.open_artifact(art_path) as a:
        base = np.frombuffer(a.mapping, np.uint8).ctypes.data
        t = a.tensors["norm"]
        v = a.array("norm")
        assert v.ctypes.data == base + a.payload_offset + t.offset
        assert not v.flags.writeable
        with pytest.raises(ValueError):
            v[0] = 1.0
        tv = a.torch_view("conv")
        assert tv.dtype == torch.bfloat16 and tuple(tv.shape) == (16, 4)
        assert tv.data_ptr() == base + a.payload_offset + a.tensors["conv"].offset
        assert torch.equal(tv.float(), torch.from_numpy(a.decode("conv")))
        assert a.to_device("conv", "cpu").data_ptr() == tv.data_ptr()      # CPU: the view itself
        del v, tv


def test_chunked_copy_reproduces_bytes(art_path):
    """The to_device copy loop, exercised with a CPU destination and a chunk smaller than the
    tensor (the GPU path only adds pinned staging buffers around the same loop)."""
    with A.open_artifact(art_path) as a:
        src = a.torch_view("embed")
        dst = torch.empty_like(src)
        A.copy_chunked(src, dst, chunk_bytes=4096 + 7)
        assert torch.equal(dst, src) and dst.data_ptr() != src.data_ptr()


# ---------------------------------------------------------------- atomic streaming writes
def _no_leftovers(d):
    return sorted(p.name for p in d.iterdir())


def test_exception_mid_stream_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="went away"):
        write(tmp_path / "m.ninfer", fail_at="layers.0.mlp.gate_up")
    assert _no_leftovers(tmp_path) == []


def test_failed_write_keeps_previous_file(tmp_path):
    p = write(tmp_path / "m.ninfer")
    before = p.read_bytes()
    with pytest.raises(RuntimeError):
        write(p, fail_at="embed")
    assert p.read_bytes() == before and _no_leftovers(tmp_path) == ["m.ninfer"]


def test_writer_rejects_misuse(tmp_path):
    specs = [A.TensorSpec("a", (4, 64), "fp32", "norm"), A.TensorSpec("b", (3,), "fp32", "norm")]
    with pytest.raises(A.WriteError, match="expected to write TensorEntry 'a' next, got 'b'"):
        with A.ArtifactWriter(tmp_path / "x.ninfer", "f", specs, []) as w:
            w.add_tensor("b", [np.zeros(3, np.float32)])
    with pytest.raises(A.WriteError, match="'a': wrote 16 bytes, declared 1024"):
        with A.ArtifactWriter(tmp_path / "x.ninfer", "f", specs, []) as w:
            w.add_tensor("a", [np.zeros(4, np.float32)])
    with pytest.raises(A.WriteError, match="not written, first 'b'"):
        with A.ArtifactWriter(tmp_path / "x.ninfer", "f", specs, []) as w:
            w.add_tensor("a", [np.zeros((4, 64), np.float32)])
    with pytest.raises(A.SchemaError, match="declared twice"):
        A.ArtifactWriter(tmp_path / "x.ninfer", "f", specs + specs[:1], [])
    with pytest.raises(A.SchemaError, match="q4.*rank"):
        A.ArtifactWriter(tmp_path / "x.ninfer", "f", [A.TensorSpec("n", (64,), "q4", "norm")], [])
    assert _no_leftovers(tmp_path) == []


def test_unwritable_directory(tmp_path):
    with pytest.raises(A.WriteError, match="cannot create a file in"):
        A.ArtifactWriter(tmp_path / "missing_dir" / "x.ninfer", "f", [], [])


# ---------------------------------------------------------------- damaged files: typed errors
def _set(doc, path, value):
    obj = doc
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


@pytest.mark.parametrize("mutate,error,pattern", [
    (lambda d: d.update(extra=1), A.SchemaError, r"directory root: unknown member\(s\) \['extra'\]"),
    (lambda d: d.pop("payload_sha256"), A.SchemaError, r"missing member\(s\) \['payload_sha256'\]"),
    (lambda d: d["tensors"][1].update(dtype="f32"), A.SchemaError, r"tensors\[1\] 'layers.0.mlp.gate_up'.*unknown"),
    (lambda d: d["tensors"][2].pop("role"), A.SchemaError, r"'norm'.*missing member\(s\) \['role'\]"),
    (lambda d: _set(d, ["tensors", 2, "role"], None), A.SchemaError, r"'norm'.*\['role'\] are null"),
    (lambda d: _set(d, ["tensors", 0, "bytes"], 40000), A.SizeMismatchError, r"'embed'.*bytes 40000.*needs"),
    (lambda d: _set(d, ["tensors", 0, "shape"], [600, 200]), A.SizeMismatchError, r"'embed'.*needs"),
    (lambda d: _set(d, ["tensors", 0, "format"], "q3"), A.SchemaError, r"'embed'.*unknown format 'q3'"),
    (lambda d: _set(d, ["tensors", 0, "layout"], "contiguous-v1"), A.SchemaError, r"'embed'.*layout"),
    (lambda d: _set(d, ["tensors", 4, "flags"], ["draft"]), A.SchemaError, r"'mtp.fc'.*flags"),
    (lambda d: _set(d, ["tensors", 2, "offset"], 100), A.SchemaError, r"'norm'.*multiple of 4096"),
    (lambda d: _set(d, ["tensors", 2, "offset"], 0), A.OverlapError, r"tensor 'embed' at \[0, 40960\) overlaps 'norm'"),
    (lambda d: _set(d, ["tensors", 3, "name"], "norm"), A.SchemaError, r"duplicate tensor name"),
    (lambda d: _set(d, ["resources", 0, "offset"], 1 << 30), A.OutOfBoundsError, r"resource 'tokenizer.json'"),
    (lambda d: _set(d, ["format_version"], 1), A.SchemaError, r"format_version 1"),
])
def test_directory_damage_is_a_typed_error(art_path, mutate, error, pattern):
    rewrite_directory(art_path, mutate)
    with pytest.raises(error, match=pattern):
        A.open_artifact(art_path)


def test_bad_magic_and_bad_json(art_path):
    raw = bytearray(art_path.read_bytes())
    art_path.write_bytes(b"GGUF" + bytes(raw[4:]))
    with pytest.raises(A.BadMagicError, match="bad magic"):
        A.open_artifact(art_path)
    raw[16] = ord("[")
    art_path.write_bytes(bytes(raw))
    with pytest.raises(A.SchemaError, match="not valid UTF-8 JSON"):
        A.open_artifact(art_path)
    art_path.write_bytes(bytes(raw[:10]))
    with pytest.raises(A.BadMagicError, match="shorter than the 16-byte prefix"):
        A.open_artifact(art_path)


def test_duplicate_json_member(art_path):
    raw = art_path.read_bytes()
    n = struct.unpack("<Q", raw[8:16])[0]
    js = raw[16:16 + n].replace(b'"model_family":"qwen3_5"', b'"model_family":"qwen3_5","model_family":"x"', 1)
    off = -(-(16 + len(js)) // 4096) * 4096
    old = -(-(16 + n) // 4096) * 4096
    art_path.write_bytes(raw[:8] + struct.pack("<Q", len(js)) + js + bytes(off - 16 - len(js)) + raw[old:])
    with pytest.raises(A.SchemaError, match="duplicate JSON member 'model_family'"):
        A.open_artifact(art_path)


def test_truncated_and_padded_files(art_path):
    raw = art_path.read_bytes()
    art_path.write_bytes(raw[:-5000])
    with pytest.raises(A.OutOfBoundsError, match=r"resource '(chat_template.jinja|config.json)'.*truncated"):
        A.open_artifact(art_path)
    art_path.write_bytes(raw + b"\0" * 4096)
    with pytest.raises(A.FileSizeError, match="trailing bytes"):
        A.open_artifact(art_path)
    art_path.write_bytes(raw[:20])
    with pytest.raises(A.OutOfBoundsError, match="JSON directory"):
        A.open_artifact(art_path)


@pytest.mark.parametrize("victim,kind", [("layers.0.mlp.gate_up", "tensor"), ("mtp.fc", "tensor"),
                                         ("tokenizer.json", "resource")])
def test_verify_names_first_corrupt_object(art_path, victim, kind):
    with A.open_artifact(art_path) as a:
        obj = a.tensors.get(victim) or a.resources[victim]
        pos = a.payload_offset + obj.offset + obj.bytes // 2
    raw = bytearray(art_path.read_bytes())
    raw[pos] ^= 0x40
    art_path.write_bytes(bytes(raw))
    with A.open_artifact(art_path) as a:        # structure is intact, so it opens
        with pytest.raises(A.DigestMismatchError, match=f"{kind} '{victim}' sha256 mismatch"):
            a.verify()


def test_verify_catches_changed_padding(art_path):
    with A.open_artifact(art_path) as a:
        t = a.tensors["norm"]
        pos = a.payload_offset + t.offset + t.bytes + 10        # inside the gap after 'norm'
    raw = bytearray(art_path.read_bytes())
    raw[pos] = 1
    art_path.write_bytes(bytes(raw))
    with A.open_artifact(art_path) as a:
        with pytest.raises(A.DigestMismatchError, match="payload_sha256"):
            a.verify()
