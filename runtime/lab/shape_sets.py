"""The bench's shape sets (`bench --shapes NAME`; the names, for a CLI that imports no torch, are
cli/parser.SHAPE_SETS): which shapes each times, as data."""

from __future__ import annotations

from .bench import Shape

# the shape sets whose rows carry the instructions per value of their module (issue 26: a regression shows)
SASS_SHAPE_SETS = ("records", "modes", "writers", "all")


def default_shapes(which: str = "targets") -> list[Shape]:
    main = dict(head_dim=512, cache_format="fp8_ds_mla", block_size=64)
    shapes = []
    if which in ("targets", "all", "quick"):
        ts = (1, 8, 64, 512, 2048, 8192) if which == "quick" else (1, 8, 64, 512, 2048, 8192, 32768)
        shapes += [Shape(n=t, h=64, p=64, **main) for t in ts]
        shapes += [
            Shape(n=t, h=h, p=h, **main)
            for h in (32, 16)
            for t in ((1, 8) if h == 32 else (1, 8, 2048, 8192))
        ]
        shapes += [Shape(n=t, h=8, p=64, zero_once=z, **main) for t in (2048, 8192) for z in (False, True)]
    if which == "baseline":  # the shapes whose torch.compile baseline is measured in a short run
        shapes += [Shape(n=t, h=64, p=64, **main) for t in (1, 64, 2048)] + [
            Shape(n=2048, h=16, p=16, **main)
        ]
    if which in ("indexer", "all", "quick"):
        for fmt in ("fp8_token", "mxfp4"):
            shapes += [Shape(n=t, h=64, p=64, head_dim=128, cache_format=fmt) for t in (1, 64, 2048, 8192)]
        shapes += [Shape(n=t, h=64, p=64, cache_format="mxfp8") for t in (1, 2048, 8192)]
    if which in ("modes", "all"):  # the op modes V4.1 engines call (MODE_TARGETS)
        for t in (1, 2048, 8192):
            shapes += [Shape(n=t, **main)]  # the full op, the modes' yardstick
            shapes += [Shape(n=t, apply_q_norm=False, **main), Shape(n=t, apply_q_rope=False, **main)]
            shapes += [Shape(n=t, apply_q_norm=False, apply_q_rope=False, **main)]
            shapes += [
                Shape(n=t, q_layout="interleaved", **main),
                Shape(n=t, cache_format="mxfp8", block_size=64),
            ]
            shapes += [
                Shape(n=t, cache_format="mxfp8", q_layout="interleaved", apply_q_norm=False, block_size=64)
            ]
            shapes += [Shape(n=t, op="kv", **main), Shape(n=t, op="kv", compress_ratio=4, **main)]
            shapes += [Shape(n=t, op="kv", cache_format="nvfp4_v41", compress_ratio=2)]
            shapes += [
                Shape(n=t, op="kv_norm", head_dim=128, cache_format=f, compress_ratio=4)
                for f in ("fp8_token", "mxfp4")
            ]
    if which in ("writers", "all"):  # issue 26's table: every writer alone, compressed, interleaved Q
        writers = [("fp8_ds_mla", 512), ("mxfp8", 512), ("nvfp4_v41", 512), ("nvfp4_dsv4", 512)]
        writers += [("fp8_token", 128), ("mxfp4", 128)]
        for t in (1, 64, 2048, 8192):
            shapes += [Shape(n=t, op="kv", head_dim=d, cache_format=f) for f, d in writers]
        for t in (1, 2048, 8192):
            shapes += [
                Shape(n=t, op="kv", compress_ratio=4, **main),
                Shape(n=t, op="kv", cache_format="nvfp4_v41", compress_ratio=2),
            ]
            shapes += [
                Shape(n=t, op="kv_norm", head_dim=128, cache_format=f, compress_ratio=4)
                for f in ("fp8_token", "mxfp4")
            ]
            shapes += [Shape(n=t, **main), Shape(n=t, q_layout="interleaved", **main)]
    if which in ("records", "all"):  # the V4.1 and NVFP4 records (FORMAT_TARGETS)
        shapes += [Shape(n=t, h=64, p=64, cache_format="nvfp4_dsv4") for t in (1, 2048, 8192)]
        for fmt in ("nvfp4_dsv4", "nvfp4_v41", "mxfp8"):
            shapes += [Shape(n=t, h=64, p=64, cache_format=fmt, op="kv") for t in (1, 2048, 8192)]
    return shapes
