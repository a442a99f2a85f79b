"""Torch reference implementations, one per op contract (`reference:` in specs/ops/*.yaml).

Each takes the op's inputs and params as keyword arguments and returns its outputs as a dict, computed
in fp32 (or wider, for the test oracles: pass fp64 tensors) and cast once to the output dtype by the
caller. They run on any device: the reference backend uses them on CPU in CI.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _norm(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x, w, eps):
    return {"y": _norm(x, eps) * w}


def rms_norm_zc(x, w, eps):
    return {"y": _norm(x, eps) * (1 + w)}


def add(a, b):
    return {"y": a + b}


def silu_and_mul(x):
    i = x.shape[-1] // 2
    return {"y": F.silu(x[..., :i]) * x[..., i:]}


def sigmoid_mul(x, g):
    return {"y": x * torch.sigmoid(g)}


def embedding(ids, table):
    ok = (ids >= 0) & (ids < table.shape[0])
    return {"y": table[ids.clamp(0, table.shape[0] - 1).long()] * ok[:, None].to(table.dtype)}


def linear(x, w):
    return {"y": x @ w.T}


REFERENCES = {f.__name__: f for f in (rms_norm, rms_norm_zc, add, silu_and_mul, sigmoid_mul, embedding, linear)}
