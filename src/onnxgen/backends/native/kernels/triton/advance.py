"""The Triton device code behind `kernels/advance.py`: a captured decode step's greedy choice and the advance
of its own inputs to the next step (`argmax_part_kernel`, `decode_advance_kernel`), and the copy of a page's
prefix in every layer (`copy_prefix_kernel`). Contracts are documented on the dispatching functions."""

import triton
import triton.language as tl

from onnxgen.backends.native.kernels.triton.core import pdl_begin


@triton.jit
def argmax_part_kernel(X, PV, PI, V, stride, C, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """`advance.greedy_advance`'s first half: program (r, c) writes the maximum of row r's columns
    `c * BLOCK ..` and the first column holding it (`PV`, `PI`: `[rows, C]`)."""
    pdl_begin(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + r * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    mx = tl.max(x, 0)
    tl.store(PV + r * C + c, mx)
    tl.store(PI + r * C + c, tl.min(tl.where((x == mx) & (offs < V), offs, 2147483647), 0))


@triton.jit
def decode_advance_kernel(
    TOP,
    PV,
    WIDE,
    NARROW,
    TOKS,
    B,
    MP,
    KMAX,
    C,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    PART: tl.constexpr,
    CP: tl.constexpr,
    PDL: tl.constexpr,
):
    """`advance.decode_advance`: one program over the rows of a captured decode step. `PART`: the tokens are
    the first maxima of the `C` partial maxima per row (`TOP`: their columns, `PV`: their values,
    `argmax_part_kernel`), the first column on ties as `torch.argmax`."""
    pdl_begin(PDL)
    r = tl.arange(0, BLOCK)
    ctl = WIDE + 4 * B  # [count of steps run, live rows]
    cnt = tl.load(ctl)
    live = tl.load(ctl + 1)
    m = r < live
    if PART:
        cc = tl.arange(0, CP)
        pm = m[:, None] & (cc < C)[None, :]
        at = r[:, None] * C + cc[None, :]
        pv = tl.load(PV + at, mask=pm, other=float("-inf"))
        pi = tl.load(TOP + at, mask=pm, other=2147483647)
        best = tl.min(tl.where(pv == tl.max(pv, 1)[:, None], pi, 2147483647), 1)
        tok = tl.where(best == 2147483647, 0, best).to(tl.int64)  # no maximum (NaN rows): token 0
    else:
        tok = tl.load(TOP + r, mask=m, other=0)
    tl.store(TOKS + (cnt % KMAX) * B + r, tok, mask=m)
    tl.store(WIDE + r, tok, mask=m)
    pos = tl.load(WIDE + B + r, mask=m, other=0) + 1
    tl.store(WIDE + B + r, pos, mask=m)
    pidx = tl.minimum(pos // PAGE, MP - 1)
    page = tl.load(NARROW + B + r * MP + pidx, mask=m, other=0).to(tl.int64)
    tl.store(WIDE + 2 * B + r, page * PAGE + pos % PAGE, mask=m)
    tl.store(NARROW + r, (pos + 1).to(tl.int32), mask=m)
    tl.store(ctl + r, cnt + 1, mask=r == 0)


@triton.jit(do_not_specialize=["src", "dst"])
def copy_prefix_kernel(DATA, src, dst, kv_stride, page_stride, ELEMS, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """`advance.copy_page_prefix`: program (layer x {K, V}, block) copies BLOCK elements of the page prefix."""
    pdl_begin(PDL)
    base = DATA + tl.program_id(0).to(tl.int64) * kv_stride
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < ELEMS
    x = tl.load(base + src.to(tl.int64) * page_stride + offs, mask=m)
    tl.store(base + dst.to(tl.int64) * page_stride + offs, x, mask=m)
