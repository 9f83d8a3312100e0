"""The Triton kernel behind :func:`packer.gpu.resample.resample_crops` (imported on first use);
with ``TRITON_INTERPRET=1`` it runs on CPU tensors in Triton's interpreter."""
import triton
import triton.language as tl


@triton.jit
def crop_resize(src, tab, out, aff, so_b, so_c, so_h, so_w, OH, OW,
                UINT8: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr):
    # One program: output rows i (BI of them) x columns j (BJ) of image b, 3 channels.
    # Per axis, output pixel i samples around source position c = start + (i + 0.5) *
    # step with PIL's BILINEAR triangle of half-width f = max(|step|, 1) (antialiased),
    # over pixels inside the image, normalised by the weights' sum: PIL's resize.
    b = tl.program_id(0)
    i_first = tl.program_id(1) * BI
    i = i_first + tl.arange(0, BI)
    j = tl.program_id(2) * BJ + tl.arange(0, BJ)
    t = tab + b * 12
    img = src + tl.load(t).to(tl.int64)
    s_c = tl.load(t + 1).to(tl.int64)
    s_r = tl.load(t + 2).to(tl.int64)
    s_x = tl.load(t + 3).to(tl.int64)
    h = tl.load(t + 4).to(tl.int32)
    w = tl.load(t + 5).to(tl.int32)
    y0 = tl.load(t + 6).to(tl.float32)
    sy = tl.load(t + 7).to(tl.float32)
    fy = tl.load(t + 8).to(tl.float32)
    x0 = tl.load(t + 9).to(tl.float32)
    sx = tl.load(t + 10).to(tl.float32)   # negative when flipped (x0 is then the right edge)
    fx = tl.load(t + 11).to(tl.float32)
    jm = j < OW
    cx = x0 + (j.to(tl.float32) + 0.5) * sx
    kx = tl.maximum(tl.floor(cx - fx - 0.5), 0.0).to(tl.int32)  # first tap per column
    taps = tl.ceil(2.0 * fx).to(tl.int32) + 2
    ix = 1.0 / fx
    wxs = tl.zeros([BJ], dtype=tl.float32)
    for q in range(0, taps):
        k = kx + q
        wxs += tl.where(k < w, tl.maximum(1.0 - tl.abs(k.to(tl.float32) + 0.5 - cx) * ix, 0.0), 0.0)
    cy = y0 + (i.to(tl.float32) + 0.5) * sy
    i_last = tl.minimum(i_first + BI, OH) - 1
    r_lo = tl.maximum(tl.floor(y0 + (i_first + 0.5) * sy - fy - 0.5), 0.0).to(tl.int32)
    r_hi = tl.minimum(tl.floor(y0 + (i_last + 0.5) * sy + fy - 0.5).to(tl.int32) + 2, h)
    iy = 1.0 / fy
    a0 = tl.zeros([BI, BJ], dtype=tl.float32)
    a1 = tl.zeros([BI, BJ], dtype=tl.float32)
    a2 = tl.zeros([BI, BJ], dtype=tl.float32)
    wys = tl.zeros([BI], dtype=tl.float32)
    for r in range(r_lo, r_hi):
        wy = tl.maximum(1.0 - tl.abs(r + 0.5 - cy) * iy, 0.0)
        wys += wy
        line = img + r * s_r  # s_r is int64: no overflow
        h0 = tl.zeros([BJ], dtype=tl.float32)
        h1 = tl.zeros([BJ], dtype=tl.float32)
        h2 = tl.zeros([BJ], dtype=tl.float32)
        for q in range(0, taps):
            k = kx + q
            m = (k < w) & jm
            wt = tl.where(m, tl.maximum(1.0 - tl.abs(k.to(tl.float32) + 0.5 - cx) * ix, 0.0), 0.0)
            p = line + k.to(tl.int64) * s_x
            h0 += wt * tl.load(p, mask=m, other=0).to(tl.float32)
            h1 += wt * tl.load(p + s_c, mask=m, other=0).to(tl.float32)
            h2 += wt * tl.load(p + 2 * s_c, mask=m, other=0).to(tl.float32)
        a0 += wy[:, None] * h0[None, :]
        a1 += wy[:, None] * h1[None, :]
        a2 += wy[:, None] * h2[None, :]
    norm = 1.0 / (tl.maximum(wys, 1e-12)[:, None] * tl.maximum(wxs, 1e-12)[None, :])
    o = out + b.to(tl.int64) * so_b + i[:, None] * so_h + j[None, :] * so_w
    om = (i[:, None] < OH) & jm[None, :]
    if UINT8:
        tl.store(o, tl.minimum(tl.maximum(tl.floor(a0 * norm + 0.5), 0.0), 255.0).to(tl.uint8), mask=om)
        tl.store(o + so_c, tl.minimum(tl.maximum(tl.floor(a1 * norm + 0.5), 0.0), 255.0).to(tl.uint8), mask=om)
        tl.store(o + 2 * so_c, tl.minimum(tl.maximum(tl.floor(a2 * norm + 0.5), 0.0), 255.0).to(tl.uint8), mask=om)
    else:
        ty = out.dtype.element_ty
        tl.store(o, (a0 * norm * tl.load(aff) + tl.load(aff + 3)).to(ty), mask=om)
        tl.store(o + so_c, (a1 * norm * tl.load(aff + 1) + tl.load(aff + 4)).to(ty), mask=om)
        tl.store(o + 2 * so_c, (a2 * norm * tl.load(aff + 2) + tl.load(aff + 5)).to(ty), mask=om)
