"""The Triton source of `kvflow.geometry.kernels` (imported only where Triton is; built
there, with `triton.jit` or Triton's interpreter). Offsets and sizes are in words; a
layer's offset (`s_layer[l]`, `d_layer[l]`) is from the first layer's first word."""

import triton.language as tl


def runs(
    src, dst, si, di, s_layer, d_layer, s_off, d_off, lens, s_stride, d_stride, tiles,
    BLOCK: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """Program (p, r * tiles + t, l): tile t of run r of block `si[p]` of layer l into the
    same of `di[p]`."""
    p = tl.program_id(0)
    r = tl.program_id(1) // tiles
    t = tl.program_id(1) % tiles
    layer = tl.program_id(2)
    n = tl.multiple_of(tl.load(lens + r), ALIGN)
    s0 = tl.load(s_layer + layer) + tl.load(si + p).to(tl.int64) * s_stride + tl.load(s_off + r)
    d0 = tl.load(d_layer + layer) + tl.load(di + p).to(tl.int64) * d_stride + tl.load(d_off + r)
    s0 = tl.multiple_of(s0, ALIGN)
    d0 = tl.multiple_of(d0, ALIGN)
    offs = t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = offs < n
    tl.store(dst + d0 + offs, tl.load(src + s0 + offs, mask=m), mask=m)


def cells(
    src, dst, s_layer, d_layer, tokens, rows_total, n_tokens,
    s_bs, s_ks, s_hs, s_ts, s_first,
    d_bs, d_ks, d_hs, d_ts, d_first,
    HEADS: tl.constexpr, S_KT: tl.constexpr, D_KT: tl.constexpr, CELL: tl.constexpr,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """Program (p, l): rows `p * ROWS ..` of layer l (a row: one token of the map, one of
    HEADS heads), each a cell of CELL words from the source's block and token into the
    destination's (WIDTH: CELL rounded up to a power of two; ALIGN divides every
    offset)."""
    layer = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = rows < rows_total
    tok = rows // HEADS
    h = rows % HEADS
    sb = tl.load(tokens + tok, mask=valid, other=0)
    st = tl.load(tokens + n_tokens + tok, mask=valid, other=0)
    db = tl.load(tokens + 2 * n_tokens + tok, mask=valid, other=0)
    dt = tl.load(tokens + 3 * n_tokens + tok, mask=valid, other=0)
    s0 = sb * s_bs + (st // S_KT) * s_ks + (st % S_KT) * s_ts + (s_first + h) * s_hs
    d0 = db * d_bs + (dt // D_KT) * d_ks + (dt % D_KT) * d_ts + (d_first + h) * d_hs
    s0 = tl.multiple_of(s0 + tl.load(s_layer + layer), ALIGN)
    d0 = tl.multiple_of(d0 + tl.load(d_layer + layer), ALIGN)
    cols = tl.arange(0, WIDTH)
    m = valid[:, None] & (cols[None, :] < CELL)
    v = tl.load(src + s0[:, None] + cols[None, :], mask=m)
    tl.store(dst + d0[:, None] + cols[None, :], v, mask=m)
