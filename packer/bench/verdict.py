"""``packer bench``'s verdict: what bounds the pipeline, what to change, and the numbers why."""
from __future__ import annotations

from typing import List

from .phases import has_module, n_workers
from .train import GPU_DECODE


def explain(rep) -> str:
    """The verdict for a ``BenchReport``: one sentence per rule that has its numbers."""
    facts = _Facts(rep)
    out: List[str] = []
    if facts.top and facts.ceiling:
        out += _bound(facts) + _reads(facts) + _workers(facts)
    out += _decoding(facts) + _packed_vs_folder(facts) + _training(facts)
    if facts.env.get("busy"):
        out.append(f"Caution: {facts.env['busy']}.")
    return " ".join(out) if out else "Not enough measurements for a verdict."


class _Facts:
    """The rows each rule reads, looked up once."""

    def __init__(self, rep):
        self.rep, self.env = rep, rep.environment
        self.cores = self.env.get("cores", 1)
        dec = rep.of("decode")
        self.full = next((r for r in dec if r["name"].startswith("decode full")), None)
        self.red = next((r for r in dec if r["name"].startswith("decode reduced-size")), None)
        self.small = next((r for r in dec if "--short-side" in r["name"]), None)
        self.ceiling = self.red["ceiling_images_per_s"] if self.red else None
        self.reads = {r["source"]: r for r in rep.of("read")}
        self.best_of = {src: max(rep.of("loader", src), key=lambda r: r["images_per_s"])
                        for src in ("packed", "folder", "staged") if rep.of("loader", src)}
        self.top = max((self.best_of[s] for s in ("packed", "staged") if s in self.best_of),
                       key=lambda r: r["images_per_s"], default=None)


def _bound(f: _Facts) -> List[str]:
    top, red, ceiling = f.top, f.red, f.ceiling
    eff = top["images_per_s"] / ceiling
    text = (f"The best loader ({top['source']}, {n_workers(top['workers'])}) delivers "
            f"{top['images_per_s']:,.0f} images/s, {eff:.0%} of the CPU decode ceiling ({f.cores} "
            f"cores x {red['images_per_s']:,.0f} images/s reduced-size decode = {ceiling:,.0f})")
    if eff >= 0.7:
        return [text + ": it is decode-bound; only less decoding per image or more cores raise it."]
    rp = f.reads.get(top["source"])
    causes = ["waiting on reads"] if rp and rp["images_per_s"] < 1.5 * ceiling else []
    e = f.rep.figures.get("loader_efficiency")  # one core's rate alone and with all busy
    if e and e["core_busy_images_per_s"] < 0.85 * e["core_images_per_s"]:
        causes.append(f"cores that slow down when all are busy (one core's ds[i] loop: "
                      f"{e['core_images_per_s']:,.0f} images/s alone, "
                      f"{e['core_busy_images_per_s']:,.0f} with {e['workers']} at once)")
    if not causes or not e or e["all_cores_busy"]["median"] < 0.85:
        causes.append("loader overhead (collating, handing batches to the main process, whose "
                      "work shares the cores)")
    causes += ["the other processes on this machine"] if f.env.get("busy") else []
    return [text + "; the rest is lost to " + ", ".join(causes[:-1])
            + (" and " if len(causes) > 1 else "") + causes[-1] + "."]


def _reads(f: _Facts) -> List[str]:
    rp = f.reads.get("packed")
    if not (rp and rp["images_per_s"] < 1.5 * f.ceiling and not rp.get("cache", "").startswith("RAM")):
        return []
    text = (f"Reads from {f.env['storage'].get('packed', 'the shards')} ({rp['cache']}) deliver "
            f"{rp['images_per_s']:,.0f} records/s ({rp['mb_per_s']:,.0f} MB/s), "
            f"{'below' if rp['images_per_s'] < f.ceiling else 'not much above'} "
            f"what the cores decode: when the data is not in the page cache, I/O bounds the "
            f"loader; stage the shards to RAM (`packer stage DST /dev/shm/NAME`), or pack "
            f"smaller images")
    if "staged" in f.best_of and "packed" in f.best_of:
        bp, bs = f.best_of["packed"]["images_per_s"], f.best_of["staged"]["images_per_s"]
        text += (f"; staging here took the best loader from {bp:,.0f} to {bs:,.0f} images/s"
                 if bs > 1.15 * bp else
                 f"; staging moved the best loader only from {bp:,.0f} to {bs:,.0f} "
                 f"images/s in this run, so reads are not what limits it now")
    return [text + "."]


def _workers(f: _Facts) -> List[str]:
    for src in ("staged", "packed"):
        by_w = sorted(f.rep.of("loader", src), key=lambda r: r["workers"])
        if len(by_w) > 1:
            b = f.best_of[src]
            if b is not by_w[-1]:
                return [f"More than {n_workers(b['workers'])} did not help the {src} loader "
                        f"(workers compete with the main process for {f.cores} cores)."]
            return [f"The {src} loader still speeds up at {n_workers(b['workers'])}: "
                    f"try --workers up to {f.cores}."] if b["workers"] < f.cores else []
    return []


def _decoding(f: _Facts) -> List[str]:
    out = []
    full, red, small = f.full, f.red, f.small
    if full and red and red["images_per_s"] > 1.15 * full["images_per_s"]:
        out.append(f"Reduced-size decoding (DecodeRandomResizedCrop) is "
                   f"{red['images_per_s'] / full['images_per_s']:.1f}x a full decode per core: keep it.")
    if small and red and small["images_per_s"] > 1.15 * red["images_per_s"]:
        side = small["name"].split("--short-side ")[1].split()[0]
        out.append(f"Packing with `packer build --short-side {side}` would decode "
                   f"{small['images_per_s'] / red['images_per_s']:.1f}x faster per core (ceiling "
                   f"{small['ceiling_images_per_s']:,.0f} images/s) for one re-encode at build time.")
    return out


def _packed_vs_folder(f: _Facts) -> List[str]:
    out = []
    reads, best_of = f.reads, f.best_of
    if "folder" in reads and "packed" in reads:
        rp, rf = reads["packed"], reads["folder"]
        text = (f"Packed vs folder: raw reads {rp['images_per_s'] / rf['images_per_s']:.2f}x "
                f"({rp['images_per_s']:,.0f} vs {rf['images_per_s']:,.0f} records/s, {rp['cache']})")
        if "packed" in best_of and "folder" in best_of:
            bp, bf = best_of["packed"], best_of["folder"]
            text += (f", best loader {bp['images_per_s'] / bf['images_per_s']:.2f}x "
                     f"({bp['images_per_s']:,.0f} vs {bf['images_per_s']:,.0f} images/s)")
        out.append(text + ".")
    if "staged" in reads and "packed" in reads:
        rs, rp = reads["staged"], reads["packed"]
        out.append(f"Staged vs packed: raw reads {rs['images_per_s'] / rp['images_per_s']:.1f}x.")
    return out


def _training(f: _Facts) -> List[str]:
    train = f.rep.of("train")
    syn = next((r for r in train if r.get("feed") == "synthetic"), None)
    fed = [r for r in train if r.get("feed") != "synthetic"]
    if not (syn and fed):
        return []
    best = max(fed, key=lambda r: r["images_per_s"])
    text = (f"Training: the model steps at {syn['images_per_s']:,.0f} images/s on a resident batch; "
            f"the best feeding ({best['feed']}) reaches {best['images_per_s']:,.0f} "
            f"({best['starvation_pct']:.0f}% starved, {best['data_wait_ms']:.1f} ms data wait per step)")
    if best["starvation_pct"] <= 10:
        return [text + ": the model bounds this pipeline, not the input."]
    if f.ceiling and f.ceiling < syn["images_per_s"]:
        gpu = (f" (packer.gpu; the '{GPU_DECODE}' row above)." if has_module("packer.gpu")
               else " (nvJPEG).")
        return [text + f": the GPU starves, and even {f.cores} cores decoding flat out "
                f"({f.ceiling:,.0f} images/s) could not keep up; pack smaller images "
                f"(--short-side) or decode on the GPU" + gpu]
    return [text + ": the GPU starves though the cores could decode fast enough: use the best "
            "feeding variant and more workers."]
