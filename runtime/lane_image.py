"""Lane images on disk (ninfer-serve --slot-save-path): a retained lane's KV pages, GDN states and tokens as one
safetensors file, the metadata (tokens, checkpoint, model digest) as JSON in its header. Engine.lane_image and
Engine.restore_lane move them between the cache and host tensors; these two move them between host tensors and a
file."""
from __future__ import annotations

import json
import os
import tempfile


def write_lane_image(path, tensors: dict, meta: dict) -> int:
    """Save a lane image (safetensors, the metadata as JSON) atomically: a temporary file beside `path`, then a
    rename, so a failed write leaves no file; returns the bytes written."""
    from safetensors.torch import save_file
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"ninfer_lane": json.dumps(meta)})
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return os.path.getsize(path)


def read_lane_image(path) -> tuple[dict, dict, int]:
    """(tensors, metadata, bytes read) of a saved lane image; ValueError when the file is not one."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, "pt") as f:
            meta = json.loads((f.metadata() or {}).get("ninfer_lane", "null"))
            if not isinstance(meta, dict) or not isinstance(meta.get("tokens"), list):
                raise ValueError(f"{os.path.basename(path)} is not a saved lane")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, json.JSONDecodeError) as e:
        raise ValueError(f"{os.path.basename(path)} is not a saved lane: {e}") from None
    return tensors, meta, os.path.getsize(path)
