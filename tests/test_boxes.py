"""Detection box maths (packer.transforms.boxes) against plain-Python per-box references."""
import random

import pytest
import torch

from packer.gpu.augment import center_crop_boxes, random_resized_crop_boxes
from packer.transforms.boxes import crop_boxes, letterbox_params

from helpers import cuda


def boxes_to_tensor(lists, dtype=torch.float32):
    """Per-image box lists to ``(boxes (N, 4), counts (B,))``, the layout crop_boxes takes."""
    parts = [torch.as_tensor(b, dtype=dtype).reshape(-1, 4) for b in lists]
    counts = torch.tensor([len(p) for p in parts], dtype=torch.long)
    return (torch.cat(parts) if parts else torch.zeros((0, 4), dtype=dtype)), counts


def split_boxes(boxes, counts):
    return list(torch.split(boxes, counts.tolist())) if len(counts) else []


def select_boxes(boxes, counts, keep):
    """``(boxes[keep], boxes kept per image)``."""
    idx = torch.repeat_interleave(torch.arange(len(counts), device=boxes.device), counts)
    new = torch.zeros(len(counts), dtype=torch.long, device=boxes.device)
    return boxes[keep], new.index_add_(0, idx, keep.long())


# -- plain-Python references ----------------------------------------------------------------

def ref_crop(box, crop, size, flip, min_visible):
    (x0, y0, x1, y1), (cx0, cy0, cx1, cy1), (oh, ow) = box, crop, size
    sx, sy = ow / (cx1 - cx0), oh / (cy1 - cy0)
    X0, X1, Y0, Y1 = (x0 - cx0) * sx, (x1 - cx0) * sx, (y0 - cy0) * sy, (y1 - cy0) * sy
    if flip:
        X0, X1 = ow - X1, ow - X0
    area = max(X1 - X0, 0) * max(Y1 - Y0, 0)
    c = [min(max(X0, 0), ow), min(max(Y0, 0), oh), min(max(X1, 0), ow), min(max(Y1, 0), oh)]
    seen = max(c[2] - c[0], 0) * max(c[3] - c[1], 0)
    return c, seen > 0 and seen >= min_visible * area


def ref_letterbox(h, w, oh, ow, scale_up=True):
    """Ultralytics' LetterBox.__call__ geometry, transcribed."""
    r = min(oh / h, ow / w)
    if not scale_up:
        r = min(r, 1.0)
    nw, nh = int(round(w * r)), int(round(h * r))
    nw, nh = max(nw, 1), max(nh, 1)  # ours: cv2.resize would refuse 0 there
    dw, dh = (ow - nw) / 2, (oh - nh) / 2
    return r, (int(round(dh - 0.1)), int(round(dw - 0.1))), (nh, nw)


def random_batch(rng, b, sizes):
    """Per-image box lists: some inside, some crossing or outside the image, some empty."""
    out = []
    for (h, w) in sizes.tolist():
        boxes = []
        for _ in range(rng.choice([0, 1, 3, 7])):
            x0, y0 = rng.uniform(-0.2 * w, w), rng.uniform(-0.2 * h, h)
            boxes.append([x0, y0, x0 + rng.uniform(1, 0.6 * w), y0 + rng.uniform(1, 0.6 * h)])
        out.append(boxes)
    return out


def random_case(seed, b=16):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    sizes = torch.tensor([[rng.randint(40, 900), rng.randint(40, 900)] for _ in range(b)])
    crops = random_resized_crop_boxes(sizes, generator=g)
    flips = torch.rand(b, generator=g) < 0.5
    return sizes, crops, flips, random_batch(rng, b, sizes)


# -- crop_boxes -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_crop_boxes_matches_reference(seed, dtype):
    sizes, crops, flips, lists = random_case(seed)
    boxes, counts = boxes_to_tensor(lists, dtype=dtype)
    for size, fl, mv in [((224, 224), flips, 0.25), ((160, 256), None, 0.5),
                         ((97, 61), flips, 0.0)]:
        out, keep = crop_boxes(boxes, counts, crops, size, fl, min_visible=mv)
        assert out.dtype == dtype and keep.dtype == torch.bool and out.shape == boxes.shape
        k = 0
        for i, n in enumerate(counts.tolist()):
            for box in boxes[k:k + n].double().tolist():
                flip = fl is not None and bool(fl[i])
                ref, ref_keep = ref_crop(box, crops[i].tolist(), size, flip, mv)
                assert out[k].double().tolist() == pytest.approx(ref, abs=1e-4)
                assert bool(keep[k]) == ref_keep
                k += 1
        assert k == len(boxes)


def test_crop_boxes_center_crop_and_select():
    sizes, _, _, lists = random_case(5)
    boxes, counts = boxes_to_tensor(lists)
    crops = center_crop_boxes(sizes, (192, 192))
    out, keep = crop_boxes(boxes, counts, crops, (192, 192))
    sel, new = select_boxes(out, counts, keep)
    per_image = split_boxes(out, counts)
    kept = split_boxes(keep, counts)
    assert new.tolist() == [int(k.sum()) for k in kept]
    assert torch.equal(sel, torch.cat([o[k] for o, k in zip(per_image, kept)]))
    assert ((sel >= 0) & (sel <= 192)).all() and (sel[:, 2:] > sel[:, :2]).all()


def test_min_visible_at_the_boundary():
    # Crop the top-left 50x50 of a 100x100 image at 1:1; the box is 30% inside (x 35..50 of 35..85).
    boxes, counts = boxes_to_tensor([[[35.0, 10.0, 85.0, 20.0]]])
    crops = torch.tensor([[0.0, 0.0, 50.0, 50.0]], dtype=torch.float64)
    for flip in (False, True):
        flips = torch.tensor([flip])
        out, keep = crop_boxes(boxes, counts, crops, (50, 50), flips, min_visible=0.25)
        assert keep.tolist() == [True]
        assert out[0].tolist() == ([0.0, 10.0, 15.0, 20.0] if flip else [35.0, 10.0, 50.0, 20.0])
        _, keep = crop_boxes(boxes, counts, crops, (50, 50), flips, min_visible=0.5)
        assert keep.tolist() == [False]
    # Wholly outside, or degenerate: dropped even with min_visible=0.
    boxes, counts = boxes_to_tensor([[[60.0, 0.0, 90.0, 10.0], [5.0, 5.0, 5.0, 9.0]]])
    _, keep = crop_boxes(boxes, counts, crops, (50, 50), min_visible=0.0)
    assert keep.tolist() == [False, False]


def test_flip_mirrors():
    boxes, counts = boxes_to_tensor([[[10.0, 20.0, 30.0, 40.0], [0.0, 0.0, 100.0, 5.0]],
                                     [[70.0, 1.0, 99.0, 2.0]]])
    crops = torch.tensor([[0.0, 0.0, 100.0, 50.0], [0.0, 0.0, 100.0, 50.0]], dtype=torch.float64)
    # Scale 2 in x, 1 in y: the output is 200 x 50.
    plain, _ = crop_boxes(boxes, counts, crops, (50, 200))
    flipped, _ = crop_boxes(boxes, counts, crops, (50, 200), torch.tensor([True, False]))
    assert plain.tolist() == [[20.0, 20.0, 60.0, 40.0], [0.0, 0.0, 200.0, 5.0],
                              [140.0, 1.0, 198.0, 2.0]]
    assert flipped.tolist() == [[140.0, 20.0, 180.0, 40.0], [0.0, 0.0, 200.0, 5.0],
                                [140.0, 1.0, 198.0, 2.0]]


def test_empty_images():
    crops = torch.tensor([[0.0, 0.0, 10.0, 10.0]] * 3, dtype=torch.float64)
    boxes, counts = boxes_to_tensor([[], [[1.0, 1.0, 4.0, 4.0], [2.0, 2.0, 9.0, 9.0]], []])
    assert counts.tolist() == [0, 2, 0] and boxes.shape == (2, 4)
    out, keep = crop_boxes(boxes, counts, crops, (20, 20), torch.tensor([True, True, False]))
    assert out.tolist() == [[12.0, 2.0, 18.0, 8.0], [2.0, 4.0, 16.0, 18.0]]
    assert [b.shape[0] for b in split_boxes(out, counts)] == [0, 2, 0]
    assert select_boxes(out, counts, keep)[1].tolist() == [0, 2, 0]
    for lists, b in (([[], [], []], 3), ([], 0)):
        boxes, counts = boxes_to_tensor(lists)
        assert boxes.shape == (0, 4) and counts.tolist() == [0] * b
        out, keep = crop_boxes(boxes, counts, crops[:b], (20, 20))
        assert out.shape == (0, 4) and keep.shape == (0,)
        assert [len(x) for x in split_boxes(boxes, counts)] == [0] * b
    with pytest.raises(ValueError, match="counts sum"):
        crop_boxes(torch.zeros(3, 4), torch.tensor([1, 1]), crops[:2], (20, 20))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtype_and_device_preserved(dtype):
    boxes = torch.tensor([[1.0, 2.0, 30.0, 40.0], [5.0, 5.0, 9.0, 9.0]], dtype=dtype)
    counts = torch.tensor([1, 1])
    crops = torch.tensor([[0.0, 0.0, 50.0, 50.0]] * 2, dtype=torch.float64)
    out, keep = crop_boxes(boxes, counts, crops, (32, 32))
    assert out.dtype == dtype and out.device == boxes.device and keep.device == boxes.device


# -- letterbox ------------------------------------------------------------------------------

def test_letterbox_params_match_ultralytics():
    rng = random.Random(0)
    hw = [(rng.randint(1, 2000), rng.randint(1, 2000)) for _ in range(200)]
    hw += [(480, 640), (640, 480), (641, 480), (100, 100), (1, 3000), (333, 500)]
    for size in [(640, 640), (384, 640), (321, 479)]:
        for scale_up in (True, False):
            scale, pad, new = letterbox_params(torch.tensor(hw), size, scale_up=scale_up)
            assert pad.dtype == new.dtype == torch.long
            for k, (h, w) in enumerate(hw):
                r, p, n = ref_letterbox(h, w, *size, scale_up)
                assert float(scale[k]) == r
                assert tuple(pad[k].tolist()) == p
                assert tuple(new[k].tolist()) == n


# -- CUDA -----------------------------------------------------------------------------------

@pytest.mark.gpu
@cuda
def test_cuda_matches_cpu():
    sizes, crops, flips, lists = random_case(7)
    boxes, counts = boxes_to_tensor(lists)
    out, keep = crop_boxes(boxes, counts, crops, (224, 224), flips)
    gout, gkeep = crop_boxes(boxes.cuda(), counts.cuda(), crops, (224, 224), flips)
    assert gout.is_cuda and gkeep.is_cuda
    assert torch.allclose(gout.cpu(), out, atol=1e-3) and torch.equal(gkeep.cpu(), keep)
    sel, new = select_boxes(gout, counts.cuda(), gkeep)
    assert torch.allclose(sel.cpu(), out[keep], atol=1e-3)
    assert torch.equal(new.cpu(), select_boxes(out, counts, keep)[1])
