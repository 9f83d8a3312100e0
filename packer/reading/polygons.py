"""COCO polygons rasterised exactly as pycocotools' ``rleFrPoly`` does, in bounded work.

``rleFrPoly`` rounds vertices to a 5x grid, walks each edge along its longer axis and keeps
one boundary point per step between ``u = 5n+2`` and ``5n+3`` (column ``n``'s centre); a
pixel is inside when an odd number of its polygon's points lie at or before it in
column-major order. Here each column crossing is computed where it happens (same double
expressions), so the work is one step per (edge, column), which ``crossings`` counts first."""
from __future__ import annotations

from typing import List, NamedTuple, Tuple

import torch

SCALE = 5.0  # rleFrPoly's upsampling
F64, I64 = torch.float64, torch.int64


class Outline(NamedTuple):
    """The edges of every polygon of some objects, as rleFrPoly walks them (ends swapped
    so the walk's axis increases), and the image columns ``[n0, n0 + count)`` each crosses."""
    obj: torch.Tensor      # the object (its index in the segmentation) of each edge
    poly: torch.Tensor     # the polygon (numbered over all objects) of each edge
    xs: torch.Tensor
    ys: torch.Tensor
    xe: torch.Tensor
    ye: torch.Tensor
    major: torch.Tensor    # walked along x (|dx| >= |dy|)
    flip: torch.Tensor     # its ends were swapped (the walk runs from (xe, ye) to (xs, ys))
    n0: torch.Tensor
    count: torch.Tensor


def outline(objects: List[Tuple[int, List[List[float]]]], width: int) -> Outline:
    """The ``Outline`` of ``(object index, polygons)`` pairs; an odd last value of a
    polygon is ignored, as rleFrPoly does."""
    polys = [p[: len(p) // 2 * 2] for _, ps in objects for p in ps]
    sizes = torch.tensor([len(p) // 2 for p in polys], dtype=I64)
    owner = torch.tensor([k for k, ps in objects for _ in ps], dtype=I64)
    flat = torch.tensor([float(v) for p in polys for v in p], dtype=F64)
    pts = (flat * SCALE + 0.5).to(I64).view(-1, 2)  # C's (int) conversion: toward zero
    poly = torch.arange(len(polys)).repeat_interleave(sizes)
    ends = sizes.cumsum(0)
    nxt = torch.arange(len(pts)) + 1
    nxt[ends[sizes > 0] - 1] = (ends - sizes)[sizes > 0]  # the last vertex closes it
    xs, ys, xe, ye = pts[:, 0], pts[:, 1], pts[nxt, 0], pts[nxt, 1]
    major = (xe - xs).abs() >= (ye - ys).abs()
    flip = major & (xs > xe) | ~major & (ys > ye)
    xs, xe = torch.where(flip, xe, xs), torch.where(flip, xs, xe)
    ys, ye = torch.where(flip, ye, ys), torch.where(flip, ys, ye)
    # u runs over [xs, xe] (x-major) or from u(0) = xs to u(dy) = xe (y-major), where it
    # matters (u >= 2); columns n with 5n+2 and 5n+3 both in that range are crossed
    lo, hi = torch.minimum(xs, xe), torch.maximum(xs, xe)
    n0 = (-torch.div(2 - lo, 5, rounding_mode="floor")).clamp(min=0)
    n1 = torch.div(hi - 3, 5, rounding_mode="floor").clamp(max=width - 1)
    count = (n1 - n0 + 1).clamp(min=0)
    return Outline(owner[poly], poly, xs, ys, xe, ye, major, flip, n0, count)


def crossings(o: Outline, objects: int) -> torch.Tensor:
    """Column crossings of each object's edges: the work its mask costs here."""
    return torch.zeros(objects, dtype=I64).index_add_(0, o.obj, o.count)


def polygon_intervals(o: Outline, height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every polygon's inside as ``[start, end)`` intervals of flat positions
    ``object * height * width + column * height + row`` (column-major, as COCO's RLE);
    overlapping where an object's polygons overlap."""
    edge = torch.arange(len(o.xs)).repeat_interleave(o.count)
    first = torch.cat([o.count.new_zeros(1), o.count.cumsum(0)[:-1]])
    n = o.n0[edge] + torch.arange(len(edge)) - first[edge]
    keep = torch.ones_like(n, dtype=torch.bool)
    v = torch.empty_like(n)
    ix, iy = o.major[edge].nonzero().flatten(), (~o.major[edge]).nonzero().flatten()
    ex, ey = edge[ix], edge[iy]
    v[ix] = x_major_rows(o.xs[ex], o.ys[ex], o.xe[ex], o.ye[ex], n[ix])
    keep[iy], v[iy] = y_major_rows(o.xs[ey], o.ys[ey], o.xe[ey], o.ye[ey], o.flip[ey], n[iy])
    y = ((v.to(F64) + 0.5) / SCALE - 0.5).clamp(0, height).ceil().to(I64)
    hw = height * width
    edge = edge[keep]
    points = o.obj[edge] * hw + n[keep] * height + y[keep]
    return parity_intervals(o.poly[edge], points, o.obj, o.poly, hw)


def x_major_rows(xs, ys, xe, ye, n) -> torch.Tensor:
    """Crossings of edges walked along x (every column from xs to xe is crossed): the lower
    ``v = (int)(ys + s*t + .5)`` of the steps ``t, t+1`` at ``u = 5n+2, 5n+3``."""
    s = (ye - ys).to(F64) / (xe - xs).to(F64)
    t = (5 * n + 2 - xs).to(F64)
    y0 = ys.to(F64)
    return torch.minimum((y0 + s * t + 0.5).to(I64), (y0 + s * (t + 1) + 0.5).to(I64))


def y_major_rows(xs, ys, xe, ye, flip, n) -> Tuple[torch.Tensor, torch.Tensor]:
    """Crossings of edges walked along y: ``u(t) = (int)(xs + s*t + .5)`` is monotonic.
    Find the first step ``t`` past the column's 5n+2|5n+3 boundary; rleFrPoly keeps a
    point there when its ``u`` test, taken in walk order, gives ``5n+2`` (a step of one,
    the usual case, always does). ``v = ys + t - 1``, the lower of the step's two."""
    dy = ye - ys
    s = (xe - xs).to(F64) / dy.to(F64)
    up, k, x0 = s > 0, (5 * n + 3).to(F64), xs.to(F64)

    def z(t):
        return x0 + s * t.to(F64) + 0.5

    def past(t):  # u(t) >= 5n+3 going up, u(t) <= 5n+2 going down
        return torch.where(up, z(t) >= k, z(t) < k)
    # Invariant: not past(lo), past(hi). The estimate brackets the step in almost every
    # case; where it does not, the whole edge does (past(0) is false, past(dy) true).
    guess = ((k - 0.5 - x0) / s).ceil().clamp(0, None).minimum(dy.to(F64)).to(I64)
    lo, hi = (guess - 2).clamp(min=0), torch.minimum(guess + 2, dy)
    wide = past(lo) | ~past(hi)
    lo, hi = torch.where(wide, 0, lo), torch.where(wide, dy, hi)
    while True:
        open_ = hi - lo > 1
        if not bool(open_.any()):
            break
        mid = (lo + hi) // 2
        p = past(mid)
        hi, lo = torch.where(open_ & p, mid, hi), torch.where(open_ & ~p, mid, lo)
    before, after = z(hi - 1).to(I64), z(hi).to(I64)
    prev, cur = torch.where(flip, after, before), torch.where(flip, before, after)
    xd = torch.where(cur < prev, cur, cur - 1)
    return (xd == 5 * n + 2) & past(hi), ys + hi - 1


def parity_intervals(poly: torch.Tensor, points: torch.Tensor, edge_obj: torch.Tensor,
                     edge_poly: torch.Tensor, hw: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per polygon, the positions with an odd number of its boundary points at or before
    them: its points sorted and paired ``[p0, p1), [p2, p3), ...``; a polygon with an odd
    count runs to the end of its object's mask (rleFrPoly's ``h * w`` sentinel)."""
    polygons = int(edge_poly.max()) + 1 if len(edge_poly) else 0
    odd = torch.bincount(poly, minlength=polygons) % 2 == 1
    extra = odd.nonzero().flatten()
    obj_of = torch.zeros(polygons, dtype=I64).scatter_(0, edge_poly, edge_obj)
    poly = torch.cat([poly, extra])
    points = torch.cat([points, (obj_of[extra] + 1) * hw])
    local = points - obj_of[poly] * hw  # 0..hw: sort by polygon, then position
    order = torch.argsort(poly * (hw + 1) + local)
    points = points[order]
    return points[0::2], points[1::2]
