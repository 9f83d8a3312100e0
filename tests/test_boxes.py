"""Detection box maths (packer.transforms.boxes) against plain-Python per-box references, and the
letterboxed image against PIL: boxes must land where the pixels of their objects do."""
import random

import pytest
import torch
from PIL import Image, ImageDraw

from packer.gpu.augment import center_crop_boxes, random_resized_crop_boxes
from packer.transforms.boxes import boxes_to_tensor, crop_boxes, letterbox, letterbox_boxes, letterbox_params, select_boxes, split_boxes

from helpers import cuda, rgb_tensor


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
        assert letterbox_boxes(boxes, counts, torch.ones(b), torch.zeros(b, 2)).shape == (0, 4)
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
    lb = letterbox_boxes(boxes, counts, torch.tensor([0.5, 2.0]), torch.tensor([[3, 0], [0, 7]]))
    assert lb.dtype == dtype
    ref = torch.tensor([[0.5, 4.0, 15.0, 23.0], [17.0, 10.0, 25.0, 18.0]])
    assert torch.allclose(lb.float(), ref, rtol=1e-2)


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


def test_letterbox_boxes_matches_reference():
    rng = random.Random(1)
    sizes = torch.tensor([[rng.randint(40, 900), rng.randint(40, 900)] for _ in range(12)])
    lists = random_batch(rng, 12, sizes)
    boxes, counts = boxes_to_tensor(lists, dtype=torch.float32)
    scale, pad, _ = letterbox_params(sizes, (384, 640))
    out = letterbox_boxes(boxes, counts, scale, pad)
    k = 0
    for i, n in enumerate(counts.tolist()):
        r, (top, left), _ = ref_letterbox(*sizes[i].tolist(), 384, 640)
        for x0, y0, x1, y1 in boxes[k:k + n].double().tolist():
            ref = [x0 * r + left, y0 * r + top, x1 * r + left, y1 * r + top]
            assert out[k].double().tolist() == pytest.approx(ref, abs=1e-4)
            k += 1


def pil_letterbox(im, size, fill):
    _, (top, left), (nh, nw) = ref_letterbox(im.height, im.width, *size)
    canvas = Image.new("RGB", size[::-1], (fill,) * 3)
    canvas.paste(im.resize((nw, nh), Image.BILINEAR), (left, top))
    return canvas


def test_letterbox_image_matches_pil(photos):
    big = photos[0]
    ims = [big, big.transpose(Image.ROTATE_90).resize((150, 260), Image.BICUBIC),
           big.crop((0, 0, 90, 60))]  # shrink wide, upscale tall, upscale small
    size, fill = (320, 384), 77
    batch, scale, pad = letterbox([rgb_tensor(im) for im in ims], size, fill=fill)
    assert batch.shape == (3, 3, *size) and batch.dtype == torch.uint8
    _, _, new = letterbox_params(torch.tensor([[im.height, im.width] for im in ims]), size)
    for k, im in enumerate(ims):
        ref = rgb_tensor(pil_letterbox(im, size, fill))
        err = (batch[k].float() - ref.float()).abs().mean()
        assert err < 2, f"image {k}: mean abs error {err:.2f} levels"
        (top, left), (nh, nw) = pad[k].tolist(), new[k].tolist()
        inside = torch.zeros(size, dtype=torch.bool)
        inside[top:top + nh, left:left + nw] = True
        assert (batch[k][:, ~inside] == fill).all()
    # Per-channel fill, shrink only: the small crop stays at 90x60, centred.
    batch, scale, pad = letterbox([rgb_tensor(ims[2])], size, fill=(1, 2, 3), scale_up=False)
    assert float(scale[0]) == 1.0 and pad[0].tolist() == [130, 147]
    assert torch.equal(batch[0, :, 130:190, 147:237], rgb_tensor(ims[2]))
    assert batch[0, :, 0, 0].tolist() == [1, 2, 3]


def green_extent(img):
    """(x0, y0, x1, y1) of the pure-green pixels of a (3, h, w) uint8 image, XYXY px."""
    r, g, b = img.int().unbind(0)
    ys, xs = torch.nonzero((g > 200) & (r < 80) & (b < 80), as_tuple=True)
    return [xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1]


def test_drawn_box_lands_where_letterbox_boxes_says(photos):
    base = photos[1]
    ims = [base.copy(), base.transpose(Image.ROTATE_90)]
    lists = [[[0.2 * im.width, 0.3 * im.height, 0.55 * im.width, 0.8 * im.height]] for im in ims]
    plain, _, _ = letterbox([rgb_tensor(im) for im in ims], (416, 416))
    for im, (box,) in zip(ims, lists):
        ImageDraw.Draw(im).rectangle([round(v) for v in box], fill=(0, 255, 0))
        box[2:] = [round(box[2]) + 1, round(box[3]) + 1]  # PIL fills through the last pixel
        box[:2] = [round(box[0]), round(box[1])]
    batch, scale, pad = letterbox([rgb_tensor(im) for im in ims], (416, 416))
    boxes, counts = boxes_to_tensor(lists)
    out = letterbox_boxes(boxes, counts, scale, pad)
    assert pad[0, 0] > 0 and pad[1, 1] > 0  # one pads top/bottom, the other left/right
    for k in range(2):
        with pytest.raises(RuntimeError):  # no such green in the photo itself
            green_extent(plain[k])
        assert green_extent(batch[k]) == pytest.approx(out[k].tolist(), abs=1)


# -- CUDA -----------------------------------------------------------------------------------

@pytest.mark.gpu
@cuda
def test_cuda_matches_cpu(photos):
    sizes, crops, flips, lists = random_case(7)
    boxes, counts = boxes_to_tensor(lists)
    out, keep = crop_boxes(boxes, counts, crops, (224, 224), flips)
    gout, gkeep = crop_boxes(boxes.cuda(), counts.cuda(), crops, (224, 224), flips)
    assert gout.is_cuda and gkeep.is_cuda
    assert torch.allclose(gout.cpu(), out, atol=1e-3) and torch.equal(gkeep.cpu(), keep)
    sel, new = select_boxes(gout, counts.cuda(), gkeep)
    assert torch.allclose(sel.cpu(), out[keep], atol=1e-3)
    assert torch.equal(new.cpu(), select_boxes(out, counts, keep)[1])
    ims = [rgb_tensor(p) for p in photos[:3]]
    batch, scale, pad = letterbox(ims, (320, 320))
    gbatch, gscale, gpad = letterbox([im.cuda() for im in ims], (320, 320))
    assert gbatch.is_cuda and gscale.is_cuda and gpad.is_cuda
    assert (gbatch.cpu().int() - batch.int()).abs().max() <= 1
    b3, c3 = boxes_to_tensor(lists[:3])
    ref = letterbox_boxes(b3, c3, scale, pad)
    assert torch.allclose(letterbox_boxes(b3.cuda(), c3.cuda(), gscale, gpad).cpu(), ref, atol=1e-3)
