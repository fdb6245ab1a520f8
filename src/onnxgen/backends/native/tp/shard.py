"""The Megatron-style sharding pass: a decoder graph's nodes (after KV binding, before the lowering's fusions)
rewritten to compute one rank's part of every layer, holding that rank's part of the weights only.

- Attention: each bound GroupQueryAttention keeps a contiguous run of query heads and the KV heads they read
  (`head_split`; KV heads replicated when there are fewer than ranks), its `num_heads` / `kv_num_heads` set
  to the local counts. The projections feeding q, k and v (packed QKV, a `Split` of it, separate q/k/v,
  biases, per-head reshapes and q/k norms on the way) keep those heads' columns (column-parallel); the one
  product reading the attention output keeps those heads' rows (row-parallel) and is followed by an
  `AllReduce` (the partial sums added across ranks) before anything else reads it (the residual sum, a
  norm).
- MLP: every other product over a constant weight (not the lm_head) is row-parallel over its input
  features, split evenly by `even_split`: the elementwise ops before it (SiLU / GELU gates, the gate * up
  product, scalar constants) and the products feeding them (gate, up) keep the same columns.
- int4 products (MatMulNBits) likewise, cut on their packed constants (`tp.nbits`): by rows (column-parallel)
  or by whole quantization blocks of the input features (row-parallel: the down projection's blocks split
  evenly, the output projection's at this rank's heads, which must be whole blocks).
- The lm_head: vocab-parallel. Each rank keeps a contiguous run of the vocabulary (`even_split`, uneven
  allowed): its columns of the weight (int4: its rows, `tp.nbits.keep_rows`), copied alone, and of any
  per-vocab bias; the per-position ops between it and the logits (a Cast to float32, a scale, a bias) work on
  that slice, and one `AllGather` after the last of them joins the slices into the whole logits on every
  rank (so rank 0's sampling reads what one process computes). An lm_head it cannot split this way (no
  product over a constant weight, a Gemm, an op between it and the logits that is not elementwise, a value
  on the way read elsewhere, an int4 lm_head with a reordering g_idx) stays replicated, as does the
  embedding (a tied one too: the lm_head's slice is a copy of its own).
- The norms, the rotary tables and everything else stay replicated.

What it cannot shard raises `UnsupportedSharding` naming the node and why: attention other than
GroupQueryAttention (plain Concat KV, ai.onnx Attention), an attention bias, an int4 product whose part is
not whole blocks or with a reordering g_idx, mixtures of experts, a reshape to a heads axis, a sharded value
read by a replicated node.

The pass works backwards over "needs": a value that must be computed only in part is mapped to the column
ranges (of its per-token feature vector, flattened) this rank keeps; walking the nodes in reverse order, each
node producing such a value passes the matching ranges on to its inputs, down to the column-parallel products
(whose weight columns are then cut).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from onnxgen.backends.native.ops import Node
from onnxgen.backends.native.tp import nbits
from onnxgen.errors import UnsupportedSharding

Ranges = tuple[tuple[int, int], ...]

_ELEMENTWISE = {
    ("", op)
    for op in (
        "Sigmoid",
        "Mul",
        "Add",
        "Sub",
        "Div",
        "Tanh",
        "Erf",
        "Relu",
        "Gelu",
        "Neg",
        "Cast",
        "Identity",
    )
} | {
    ("com.microsoft", "FastGelu"),
    ("com.microsoft", "QuickGelu"),
    ("com.microsoft", "Gelu"),
    ("onnxgen", "Silu"),
    ("onnxgen", "SiluMul"),
    ("onnxgen", "GeluMul"),
}
_PER_POSITION = {"Cast", "Identity", "Tanh", "Mul", "Div", "Add", "Sub", "Softcap"}
_NORMS = {("", "SimplifiedLayerNormalization"), ("com.microsoft", "SimplifiedLayerNormalization")}


def even_split(size: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous part `[a, b)` of `size` items, sizes differing by at most one."""
    return size * rank // world, size * (rank + 1) // world


def head_split(heads: int, kv_heads: int, rank: int, world: int) -> tuple[int, int, int, int] | None:
    """`(qa, qb, ka, kb)`: the query heads `[qa, qb)` and KV heads `[ka, kb)` rank `rank` of `world` computes;
    every local query head reads a local KV head in the same grouping as the whole. With at least as many KV
    heads as ranks the KV heads are split evenly (the query heads follow their groups); with fewer, each rank
    takes an equal run of query heads inside one KV head, which it then holds (replicated). None when neither
    works (the query heads cannot be split evenly inside the KV groups)."""
    group = heads // kv_heads
    if kv_heads >= world:
        ka, kb = even_split(kv_heads, rank, world)
        return ka * group, kb * group, ka, kb
    if heads % world or group % (heads // world):
        return None
    per = heads // world
    qa = rank * per
    return qa, qa + per, qa // group, qa // group + 1


def _cut(ranges: Ranges) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges])


def _width(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


@dataclass
class Sharder:
    """One rank's sharding of a decoder graph: `__call__(nodes, consts, spec)` is the lowering's `shard` hook
    (`lowering.lower(..., shard=...)`); `comm` is the group its collective nodes run over. After the call,
    `heads` / `kv_heads` are this rank's attention heads (a KV cache of `kv_heads` heads per layer), `vocab`
    this rank's vocabulary rows `[a, b)` of the lm_head (None: replicated) and `sharded` counts the products
    cut ("row", "column", "vocab")."""

    rank: int
    world: int
    comm: Any  # what the collective ops call (`tp.comm.Comm`)
    heads: int = 0
    kv_heads: int = 0
    vocab: tuple[int, int] | None = None
    sharded: dict[str, int] = field(default_factory=dict)

    def __call__(self, nodes: list[Node], consts: dict[str, torch.Tensor], spec: Any) -> list[Node]:
        return _Pass(self, nodes, consts, spec).run()


class _Pass:
    def __init__(self, sh: Sharder, nodes: list[Node], consts: dict[str, torch.Tensor], spec: Any) -> None:
        self.sh, self.nodes, self.consts, self.spec = sh, nodes, consts, spec
        self.d = int(spec.head_size)
        self.producer = {o: n for n in nodes for o in n.outputs if o}
        self.readers: dict[str, list[Node]] = {}
        for n in nodes:
            for x in n.inputs:
                if x:
                    self.readers.setdefault(x, []).append(n)
        self.need: dict[str, tuple[Ranges, int]] = {}  # value -> (kept ranges, full width)
        self.region: set[int] = set()  # nodes computing a part (their outputs' readers must be too)
        self.reduce_after: list[Node] = []  # row-parallel products
        self.head: Node | None = None  # the lm_head

    def bad(self, n: Node, why: str) -> UnsupportedSharding:
        return UnsupportedSharding(f"{n.domain + '::' if n.domain else ''}{n.op}", n.name, why, self.sh.world)

    def const(self, name: str) -> torch.Tensor | None:
        return self.consts.get(name) if name else None

    def put(self, base: str, t: torch.Tensor) -> str:
        """A new constant (a copy: this rank holds its part only) under a name of its own (two cuts of one
        initializer, e.g. by two nodes, get two names)."""
        name, k = f"{base}::tp{self.sh.rank}", 0
        while name in self.consts:
            k += 1
            name = f"{base}::tp{self.sh.rank}.{k}"
        self.consts[name] = t.contiguous().clone() if t.is_contiguous() else t.contiguous()
        return name

    def ask(self, n: Node, value: str, ranges: Ranges, width: int) -> None:
        """`value` is needed only at `ranges` of its `width` features (asked by node `n`)."""
        if value in self.consts:
            raise self.bad(n, f"reads the constant {value!r} where a sharded value is expected")
        old = self.need.get(value)
        if old is not None and old != (ranges, width):
            raise self.bad(n, f"{value!r} is needed in two different parts")
        self.need[value] = (ranges, width)

    # --- the pass ---------------------------------------------------------------------------------------

    def run(self) -> list[Node]:
        lm_head = self.head = self._lm_head()
        gather = self._vocab_parallel(lm_head)
        for n in self.nodes:
            if n.domain == "com.microsoft" and n.op in ("MoE", "QMoE"):
                raise self.bad(n, "mixtures of experts are not sharded yet")
            if nbits.is_nbits(n) and n is not lm_head and (why := nbits.problem(n, self.consts)):
                raise self.bad(n, why)
        for n in self.nodes:  # attention first: its output projections are not the MLP's
            if n.layer is not None:
                self._attention(n)
        for n in reversed(self.nodes):
            if id(n) in self.region:
                continue
            if any(o in self.need for o in n.outputs if o):
                self._propagate(n)
            elif self._is_product(n) and n is not lm_head:
                self._row_parallel(n)
        for value in self.need:
            for r in self.readers.get(value, []):
                if id(r) not in self.region:
                    raise self.bad(r, f"reads the sharded value {value!r} but is not sharded itself")
        out: list[Node] = []
        for n in self.nodes:
            out.append(n)
            if any(n is r for r in self.reduce_after):
                partial = n.outputs[0] + "::partial"
                out.append(
                    Node(
                        "AllReduce",
                        "onnxgen",
                        n.name + "::all_reduce",
                        [partial],
                        [n.outputs[0]],
                        {"_comm": self.sh.comm},
                    )
                )
                n.outputs = [partial, *n.outputs[1:]]
            if gather is not None and gather.inputs[0] in n.outputs:
                out.append(gather)
        return out

    def _is_product(self, n: Node) -> bool:
        """A product over a constant weight: a MatMul's `[K, N]` or an int4 MatMulNBits' packed `[N, K]`."""
        if nbits.is_nbits(n):
            return n.inputs[1] in self.consts
        return (
            n.domain == ""
            and n.op == "MatMul"
            and (w := self.const(n.inputs[1])) is not None
            and w.dim() == 2
        )

    def _features(self, n: Node) -> tuple[int, int]:
        """A product's `(input, output)` feature counts."""
        if nbits.is_nbits(n):
            k, nn, _, _ = nbits.dims(n)
            return k, nn
        w = self.consts[n.inputs[1]]
        return int(w.shape[0]), int(w.shape[1])

    def _keep_inputs(self, n: Node, a: int, b: int) -> None:
        """Row-parallel: product `n` reads its input features `[a, b)` only (int4: whole blocks)."""
        if nbits.is_nbits(n):
            k, _, block, _ = nbits.dims(n)
            if a % block or (b % block and b != k):
                raise self.bad(
                    n, f"this rank's input features [{a}, {b}) are not whole int4 blocks of {block}"
                )
            nbits.keep_blocks(n, self.consts, self.put, a // block, -(-b // block), self.sh.rank)
        else:
            n.inputs = [n.inputs[0], self.put(n.inputs[1], self.consts[n.inputs[1]][a:b])]
        self.region.add(id(n))
        self.reduce_after.append(n)
        self.sh.sharded["row"] = self.sh.sharded.get("row", 0) + 1

    def _lm_head(self) -> Node | None:
        """The product that computes the logits (through per-position ops), if any."""
        cur = self.producer.get(self.spec.logits_name)
        while cur is not None and cur.op in _PER_POSITION and cur.domain == "":
            dyn = [x for x in cur.inputs if x and x not in self.consts]
            cur = self.producer.get(dyn[0]) if len(dyn) == 1 else None
        return cur

    def _vocab_parallel(self, head: Node | None) -> Node | None:
        """Cut the lm_head `head` to this rank's vocabulary rows and gather the logits after it: the
        `AllGather` node (placed after the logits' producer, which now writes this rank's slice), or None
        when the lm_head stays replicated (see the module's docstring)."""
        if head is None or not self._is_product(head) or len(head.outputs) != 1:
            return None
        if nbits.is_nbits(head) and nbits.problem(head, self.consts):
            return None
        vocab = self._features(head)[1]
        logits = self.spec.logits_name
        if vocab < self.sh.world or self.readers.get(logits):
            return None
        cur = self.producer[logits]
        while cur is not head:  # per-position ops with one dynamic input (`_lm_head`)
            if (cur.domain, cur.op) not in _ELEMENTWISE or len(cur.outputs) != 1:
                return None
            consts = [c for x in cur.inputs if (c := self.const(x)) is not None]
            if any(c.numel() != 1 and (c.dim() != 1 or c.numel() != vocab) for c in consts):
                return None
            (x,) = [x for x in cur.inputs if x and x not in self.consts]
            if len(self.readers.get(x, [])) != 1:
                return None
            cur = self.producer[x]
        world = self.sh.world
        sizes = [b - a for a, b in (even_split(vocab, r, world) for r in range(world))]
        a, b = even_split(vocab, self.sh.rank, world)
        last = self.producer[logits]
        local = logits + "::local"
        last.outputs = [local if o == logits else o for o in last.outputs]
        gather = Node(
            "AllGather",
            "onnxgen",
            "onnxgen/lm_head_all_gather",
            [local],
            [logits],
            {"_comm": self.sh.comm, "sizes": sizes},
        )
        self.producer[local], self.readers[local] = last, [gather]
        self.region.add(id(gather))
        self.ask(gather, local, ((a, b),), vocab)
        self.sh.vocab = (a, b)
        return gather

    def _attention(self, g: Node) -> None:
        if not (g.op == "GroupQueryAttention" and g.domain == "com.microsoft"):
            raise self.bad(
                g, "only GroupQueryAttention is sharded (this attention's KV is not split by heads)"
            )
        ins = g.inputs + [""] * 17
        if ins[10]:
            raise self.bad(g, "an attention bias input is not sharded yet")
        n, kv, d = int(g.attr("num_heads")), int(g.attr("kv_num_heads")), self.d
        split = head_split(n, kv, self.sh.rank, self.sh.world)
        if split is None:
            raise self.bad(g, f"{n} query heads in {kv} KV groups cannot be split over {self.sh.world} ranks")
        qa, qb, ka, kb = split
        if self.sh.heads and (self.sh.heads, self.sh.kv_heads) != (qb - qa, kb - ka):
            raise self.bad(g, "its heads split differently from another layer's")
        self.sh.heads, self.sh.kv_heads = qb - qa, kb - ka
        self.region.add(id(g))
        q = ((qa * d, qb * d),)
        k = ((ka * d, kb * d),)
        if not ins[1]:  # packed QKV
            off_k, off_v = n * d, (n + kv) * d
            packed = (*q, *((a + off_k, b + off_k) for a, b in k), *((a + off_v, b + off_v) for a, b in k))
            self.ask(g, ins[0], packed, (n + 2 * kv) * d)
        else:
            self.ask(g, ins[0], q, n * d)
            self.ask(g, ins[1], k, kv * d)
            self.ask(g, ins[2], k, kv * d)
        if ins[11]:  # head_sink: one value per query head
            sink = self.const(ins[11])
            if sink is None:
                raise self.bad(g, "its head_sink is not a constant")
            g.inputs[11] = self.put(ins[11], sink.reshape(-1)[qa:qb])
        for i in (14, 15):  # q / k norm weights: per head dimension, replicated
            if ins[i] and (w := self.const(ins[i])) is not None and w.numel() != d:
                raise self.bad(g, "its q/k norm weights are not per head dimension")
        g.attrs["num_heads"], g.attrs["kv_num_heads"] = qb - qa, kb - ka
        users = self.readers.get(g.outputs[0], [])
        if len(users) != 1 or not self._is_product(users[0]) or users[0].inputs[0] != g.outputs[0]:
            raise self.bad(g, "its output is not read by exactly one output projection (MatMul)")
        o = users[0]
        k = self._features(o)[0]
        if k != n * d:
            raise self.bad(o, f"the output projection reads {k} features, not {n} heads x {d}")
        self._keep_inputs(o, qa * d, qb * d)

    def _row_parallel(self, n: Node) -> None:
        """A product that is no attention's output projection nor the lm_head: row-parallel over its input
        features (the MLP's down projection; int4: its whole blocks split evenly), the ops before it
        column-parallel."""
        k = self._features(n)[0]
        if nbits.is_nbits(n):
            _, _, block, nb = nbits.dims(n)
            if nb < self.sh.world:
                raise self.bad(n, f"its {nb} int4 blocks of input features cannot be split over the ranks")
            ba, bb = even_split(nb, self.sh.rank, self.sh.world)
            a, b = ba * block, min(bb * block, k)
        else:
            a, b = even_split(k, self.sh.rank, self.sh.world)
        self._keep_inputs(n, a, b)
        self.ask(n, n.inputs[0], ((a, b),), k)

    def _propagate(self, n: Node) -> None:
        """`n` produces a value needed in part: cut what it reads accordingly."""
        self.region.add(id(n))
        key = (n.domain, n.op)
        if key == ("", "Split"):
            self._split(n)
            return
        if len([o for o in n.outputs if o and self.readers.get(o)]) != 1:
            raise self.bad(n, "produces several values read later")
        ranges, width = self.need[n.outputs[0]]
        if self._is_product(n):
            out = self._features(n)[1]
            if out != width:
                raise self.bad(n, f"its {out} output features are not the {width} expected")
            if nbits.is_nbits(n):
                nbits.keep_rows(n, self.consts, self.put, _cut(ranges))
            else:
                w = self.consts[n.inputs[1]]
                n.inputs = [n.inputs[0], self.put(n.inputs[1], w.index_select(1, _cut(ranges)))]
            how = "vocab" if n is self.head else "column"
            self.sh.sharded[how] = self.sh.sharded.get(how, 0) + 1
            return
        if key in _ELEMENTWISE:
            for i, x in enumerate(n.inputs):
                if not x:
                    continue
                c = self.const(x)
                if c is None:
                    self.ask(n, x, ranges, width)
                elif c.numel() == 1:
                    continue
                elif c.dim() == 1 and c.numel() == width:  # a bias over the features
                    n.inputs[i] = self.put(x, c[_cut(ranges)])
                else:
                    raise self.bad(
                        n, f"its constant {x!r} of shape {tuple(c.shape)} is not a scalar or a bias"
                    )
            return
        if key == ("", "Reshape"):
            self._reshape(n, ranges, width)
            return
        if key in _NORMS:
            w = self.const(n.inputs[1]) if len(n.inputs) > 1 else None
            if (
                int(n.attr("axis", -1)) != -1
                or w is None
                or w.numel() != self.d
                or any(a % self.d or b % self.d for a, b in ranges)
            ):
                raise self.bad(n, "a norm across sharded features (only per-head norms are sharded)")
            self.ask(n, n.inputs[0], ranges, width)
            return
        raise self.bad(n, "this op is not sharded (it produces a value computed in part)")

    def _reshape(self, n: Node, ranges: Ranges, width: int) -> None:
        """A reshape between `[..., heads * d]` and `[..., heads, d]`-like layouts (per token, head-major):
        the full width in its shape becomes the local one."""
        shape = self.const(n.inputs[1])
        if shape is None or any(a % self.d or b % self.d for a, b in ranges):
            raise self.bad(n, "a reshape of a sharded value with a computed shape")
        vals = [int(v) for v in shape.reshape(-1).tolist()]
        if any(v not in (0, -1, self.d, width) for v in vals):
            raise self.bad(n, f"a reshape to {vals}: only [.., -1, head size] or [.., features] are sharded")
        local = [_width(ranges) if v == width else v for v in vals]
        n.inputs = [n.inputs[0], self.put(n.inputs[1], torch.tensor(local, dtype=shape.dtype))]
        self.ask(n, n.inputs[0], ranges, width)

    def _split(self, n: Node) -> None:
        sizes = n.attrs.get("split")
        if sizes is None and len(n.inputs) > 1:
            c = self.const(n.inputs[1])
            sizes = c.tolist() if c is not None else None
        if sizes is None or int(n.attr("axis", 0)) not in (-1, 2) or len(sizes) != len(n.outputs):
            raise self.bad(n, "a split of a sharded value without constant sizes over the last axis")
        kept: list[tuple[int, int]] = []
        local: list[int] = []
        off = 0
        for o, size in zip(n.outputs, sizes, strict=True):
            if o not in self.need:
                raise self.bad(n, f"its output {o!r} is not read by a sharded node")
            ranges, width = self.need[o]
            if width != size:
                raise self.bad(n, f"its output {o!r} has {size} features, not the {width} expected")
            kept.extend((a + off, b + off) for a, b in ranges)
            local.append(_width(ranges))
            off += size
        if "split" in n.attrs:
            n.attrs["split"] = local
        else:
            n.inputs = [n.inputs[0], self.put(n.inputs[1], torch.tensor(local, dtype=torch.int64))]
        self.ask(n, n.inputs[0], tuple(kept), off)


ShardHook = Callable[[list[Node], dict[str, torch.Tensor], Any], list[Node]]
