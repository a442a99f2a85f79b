"""Named tolerance presets (specs/tolerances.yaml): the only way tests compare results with references."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    ok: bool
    detail: str

    def __bool__(self):
        return self.ok


def compare(out: torch.Tensor, ref: torch.Tensor, preset: dict, name: str = "") -> Verdict:
    """Pass if finite and (strict allclose, or all tail caps: violating fraction, worst ratio, relative L2)."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if o.shape != r.shape:
        return Verdict(False, f"{name}: shape {tuple(o.shape)} != reference {tuple(r.shape)}")
    if not torch.isfinite(o).all():
        return Verdict(False, f"{name}: {int((~torch.isfinite(o)).sum())} non-finite values")
    diff = (o - r).abs()
    bound = preset["atol"] + preset["rtol"] * r.abs()
    bad = diff > bound
    frac = bad.double().mean().item() if o.numel() else 0.0
    ratio = torch.where(bound > 0, diff / bound, torch.where(diff > 0, torch.inf, 0.0)).max().item() if o.numel() else 0.0
    rel_l2 = (diff.norm() / r.norm()).item() if r.norm() > 0 else (0.0 if diff.norm() == 0 else float("inf"))
    detail = (f"{name}: max|d|={diff.max().item() if o.numel() else 0:.3e} violating={frac:.2e} "
              f"worst_ratio={ratio:.2f} rel_l2={rel_l2:.2e}")
    if not bad.any():
        return Verdict(True, detail + " (allclose)")
    ok = frac <= preset["tail_frac"] and ratio <= preset["worst_ratio"] and rel_l2 <= preset["rel_l2"]
    return Verdict(ok, detail + (" (tail caps)" if ok else " EXCEEDS " + str(preset)))
