"""The image pipeline ahead of a decoder: vision graph -> embedding graph -> the decoder fed `inputs_embeds`
and MRoPE position ids. `MultimodalDecoder` obeys the Decoder contract (`backends/base.py`) around an inner
decoder of either backend whose graph takes embeddings.

A forward's tokens may hold image keys (`package/attachments.py`): the k-th token of image s. The images
themselves come with the request (`inputs[IMAGES]`, `ImageInput`s). For each forward:

1. the features of every image with a key among the tokens: the vision graph runs once per image, its
   output cached by the image's digest (`Parts.features`: an LRU bounded in bytes, shared by the decoder's
   forks), so a later turn or another request repeating the image does not run it again;
2. the embedding graph over the tokens (keys made placeholders again) and the feature rows of the keys, in
   order: the k-th key's row is row k of its image's features, so a chunk may start or end inside an image
   (text alone, on the native backend: a gather from the graph's token table where it gives those rows);
3. the 3-row (temporal, height, width) position of each token, as transformers' `get_rope_index`: a text
   token one past the largest position before it; the tokens of an image laid out on its merged grid from
   the position its first token would have had as text, the position after the image that plus the larger
   grid side. A position depends only on the tokens before it (and the images they name), so it is computed
   incrementally from the cached context's positions (`_pos`, kept beside the KV, cut by `rewind_to`);
4. the inner decoder's forward with `inputs_embeds` and `position_ids` `[3, 1, n]`.

The vision and embedding graphs run where the decoder does: on onnxruntime (CPU) for the ort backend, lowered
to torch on the decoder's device for the native one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnxgen.errors import InvalidRequest, MissingRequiredInput
from onnxgen.package.attachments import IMAGES, KEY_BASE, KEY_STRIDE, ImageInput, has_keys, split_key
from onnxgen.package.spec import ModelSpec


class _OrtGraph:
    """A graph on onnxruntime's CPU provider: numpy in, numpy out."""

    def __init__(self, path: Any, output: str, threads: int | None) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.output = output

    def run(self, feeds: Mapping[str, Any]) -> Any:
        return self.session.run([self.output], dict(feeds))[0]

    def rows(self, n: int, hidden: int, like: str) -> np.ndarray:
        kind = next(i.type for i in self.session.get_inputs() if i.name == like)
        return np.zeros((n, hidden), dtype=np.float16 if kind == "tensor(float16)" else np.float32)

    @staticmethod
    def cat(parts: Sequence[Any]) -> Any:
        return np.concatenate(parts)


class _NativeGraph:
    """A graph lowered by the native backend (`lowering.lower_graph`), run eagerly: torch tensors on the
    device out (inputs moved there)."""

    def __init__(self, path: Any, output: str, device: str) -> None:
        import onnx
        import torch

        from onnxgen.backends.native.device import Staging, torch_device
        from onnxgen.backends.native.lowering import lower_graph, plain_ctx

        self._torch, self._ctx = torch, plain_ctx
        self.device = torch_device(device)
        self._staging, self._lock = Staging(self.device), threading.Lock()  # `lookup`'s uploads
        self.program = lower_graph(path, output, self.device)
        graph = onnx.load(str(path), load_external_data=False).graph
        names = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16}
        self._dtypes = {i.name: names.get(i.type.tensor_type.elem_type) for i in graph.input}

    def run(self, feeds: Mapping[str, Any]) -> Any:
        torch = self._torch
        env = self.program.new_env()
        for name, v in feeds.items():
            t = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(v))
            env[self.program.input_slots[name]] = t.to(self.device)
        with torch.inference_mode():
            return self.program.execute(env, self._ctx())

    def table(self, ids: str) -> Any:
        """The constant `[vocab, hidden]` table an axis-0 Gather of the input `ids` reads, or None."""
        for st in self.program.steps:
            n = st.node
            if n.op == "Gather" and n.domain == "" and n.inputs[1:2] == [ids] and not n.attr("axis", 0):
                t = self.program.consts.get(st.ins[0])
                if t is not None and t.dim() == 2:
                    return t
        return None

    def lookup(self, table: Any, ids: np.ndarray) -> Any:
        """`[1, n, hidden]`: rows `ids` of `table` (a device tensor), the ids uploaded without a stream sync."""
        torch = self._torch
        idx = torch.empty(len(ids), dtype=torch.int64, device=self.device)
        with self._lock:
            self._staging.upload(torch.as_tensor(np.ascontiguousarray(ids, dtype=np.int64)), idx)
        return table.index_select(0, idx).unsqueeze(0)

    def rows(self, n: int, hidden: int, like: str) -> Any:
        dtype = self._dtypes.get(like) or self._torch.float32
        return self._torch.zeros((n, hidden), dtype=dtype, device=self.device)

    def cat(self, parts: Sequence[Any]) -> Any:
        return self._torch.cat(list(parts))


class Parts:
    """A package's vision and embedding graphs and the image features computed so far, by digest, least
    recently used dropped past `cache_bytes`. `backend` "ort": onnxruntime sessions (numpy); "native": the
    graphs lowered to torch on `device`. Thread-safe; shared by a decoder's forks."""

    def __init__(
        self,
        spec: ModelSpec,
        backend: str = "ort",
        device: str = "cpu",
        threads: int | None = None,
        cache_bytes: int = 256 << 20,
    ) -> None:
        mm = spec.multimodal
        assert mm is not None and spec.inputs_embeds_name is not None
        self.spec, self.mm = spec, mm
        v, e = mm.vision, mm.embedding
        if backend == "native":
            self.vision: Any = _NativeGraph(v.path, v.image_features, device)
            self.embedding: Any = _NativeGraph(e.path, e.inputs_embeds, device)
        else:
            self.vision = _OrtGraph(v.path, v.image_features, threads)
            self.embedding = _OrtGraph(e.path, e.inputs_embeds, threads)
        self._empty = self.embedding.rows(0, spec.hidden_size, e.image_features)
        self._table = self._text_table() if backend == "native" else None
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, Any] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self.vision_runs = 0
        self.cache_hits = 0
        # the images seen, by serial (what a context's keys need to be laid out again: `import_kv`)
        self._seen: OrderedDict[int, ImageInput] = OrderedDict()

    def remember(self, images: Sequence[ImageInput]) -> None:
        """Keep the grids of `images` by serial (least recently seen forgotten past 65536)."""
        with self._lock:
            for im in images:
                if im.serial in self._seen:
                    self._seen.move_to_end(im.serial)
                else:
                    self._seen[im.serial] = ImageInput(im.digest, im.serial, None, im.grid, im.merge)
                    if len(self._seen) > 1 << 16:
                        self._seen.popitem(last=False)

    def counters(self) -> dict[str, int]:
        """`vision_runs` (the vision graph's runs so far), `vision_cache_hits` (images whose features were
        found by digest) and `images_cached` (the features held now)."""
        with self._lock:
            return {
                "vision_runs": self.vision_runs,
                "vision_cache_hits": self.cache_hits,
                "images_cached": len(self._cache),
            }

    def seen(self, serial: int) -> ImageInput | None:
        """The image of `serial` (without its pixels) if this process's decoders have run it."""
        with self._lock:
            return self._seen.get(serial)

    def features(self, image: ImageInput) -> Any:
        """`[image.tokens, hidden]` features of `image` (the vision graph's, or the cached ones), in the
        backend's array type."""
        with self._lock:
            cached = self._cache.get(image.digest)
            if cached is not None:
                self._cache.move_to_end(image.digest)
                self.cache_hits += 1
                return cached
        v = self.mm.vision
        grid = np.asarray([image.grid], dtype=np.int64)
        out = self.vision.run({v.pixel_values: image.pixel_values, v.image_grid_thw: grid})
        assert out.shape[0] == image.tokens, (
            f"the vision graph gave {out.shape[0]} rows for {image.tokens} tokens"
        )
        size = out.shape[0] * out.shape[1] * out.dtype.itemsize
        with self._lock:
            self.vision_runs += 1
            if image.digest not in self._cache:
                self._cache[image.digest] = out
                self._held += size
            while self._held > self.cache_bytes and len(self._cache) > 1:
                old = self._cache.popitem(last=False)[1]
                self._held -= old.shape[0] * old.shape[1] * old.dtype.itemsize
        return out

    def rows(self, runs: Sequence[tuple[ImageInput, int, int]]) -> Any:
        """The feature rows `[k0, k1)` of each `(image, k0, k1)`, in order (no runs: no rows)."""
        if not runs:
            return self._empty
        return self.embedding.cat([self.features(im)[k0:k1] for im, k0, k1 in runs])

    def embed(self, ids: np.ndarray, rows: Any) -> Any:
        """`[1, n, hidden]` embeddings of `ids` (`[n]`, placeholders where images go) with `rows` (`[k, hidden]`)
        at the k placeholders. Text alone (a decode step): read from the graph's table where `_text_table`
        found it (the graph's values, one gather instead of the whole graph)."""
        if self._table is not None and rows.shape[0] == 0 and not (ids == self.mm.image_token_id).any():
            return self.embedding.lookup(self._table, ids)
        e = self.mm.embedding
        return self.embedding.run({e.input_ids: ids.reshape(1, -1), e.image_features: rows})

    def _text_table(self) -> Any:
        """The native embedding graph's token table when the graph gives text tokens its rows: a constant
        `[vocab, hidden]` gathered by `input_ids` (`_NativeGraph.table`) whose rows equal the graph's output,
        dtype and bits, for probe ids across the vocabulary (any scaling, cast or other op on the way fails
        the check: the graph then runs for every forward). None otherwise."""
        import torch

        t = self.embedding.table(self.mm.embedding.input_ids)
        if t is None or t.shape[1] != self.spec.hidden_size:
            return None
        probe = np.unique(np.linspace(0, t.shape[0] - 1, 9).astype(np.int64))
        probe = probe[probe != self.mm.image_token_id]
        e = self.mm.embedding
        out = self.embedding.run({e.input_ids: probe.reshape(1, -1), e.image_features: self._empty})
        want = t.index_select(0, torch.as_tensor(probe).to(t.device))
        ok = out.dtype == want.dtype and torch.equal(out.reshape(want.shape), want)
        return t if ok else None


class MultimodalDecoder:
    """The Decoder contract over `inner` (a decoder whose graph takes `inputs_embeds`) and `parts` (see the
    module doc). `info` adds the shared `Parts.counters`.
    `import_kv` takes contexts whose images this process ran (the host tier's; image keys are never saved)."""

    def __init__(self, inner: Any, parts: Parts) -> None:
        self.inner = inner
        self.parts = parts
        self.spec = inner.spec
        self.backend = inner.backend
        self.device = inner.device
        self.can_rewind = inner.can_rewind
        mm = parts.mm
        self._placeholder = mm.image_token_id
        self._pos = np.zeros((3, 0), dtype=np.int64)  # positions of the cached tokens
        self._next = 0  # the position of a text token after them

    # --- the KV seam -----------------------------------------------------------------------------------

    def kv_len(self) -> int:
        return self.inner.kv_len()

    def rewind_to(self, n: int) -> bool:
        if not self.inner.rewind_to(n):
            return False
        self._cut(n)
        return True

    def reset(self) -> None:
        self.inner.reset()
        self._cut(0)

    def _cut(self, n: int) -> None:
        self._pos = self._pos[:, :n]
        self._next = int(self._pos.max()) + 1 if n else 0

    # --- memory and lifetime ------------------------------------------------------------------------------

    def kv_bytes(self) -> int:
        return self.inner.kv_bytes()

    def export_kv(self) -> list[tuple[Any, Any]]:
        return self.inner.export_kv()

    def import_kv(self, tokens: Sequence[int], layers: Sequence[tuple[Any, Any]]) -> None:
        """The contract's `import_kv`; the positions of `tokens` laid out again, their images' grids from those
        this process ran (`Parts.seen`). Raises `InvalidRequest` (nothing attached) for an image it never ran
        (keys name images of one process: `kv.files` never saves them)."""
        ids = np.asarray(tokens, dtype=np.int64)
        images: dict[int, ImageInput] = {}
        if has_keys(tokens):
            for serial in dict.fromkeys(((ids[ids >= KEY_BASE] - KEY_BASE) // KEY_STRIDE).tolist()):
                img = self.parts.seen(serial)
                if img is None:
                    raise InvalidRequest("a context names an image this process never ran", field="inputs")
                images[serial] = img
        self.inner.import_kv(tokens, layers)
        self._cut(0)
        self._pos, self._next = self._positions(ids, images)

    @property
    def info(self) -> dict[str, Any]:
        return {**self.inner.info, **self.parts.counters()}

    def close(self) -> None:
        self.inner.close()
        self._cut(0)

    def fork(self) -> MultimodalDecoder:
        return MultimodalDecoder(self.inner.fork(), self.parts)

    # --- running ----------------------------------------------------------------------------------------

    def forward(
        self, tokens: Sequence[int], start_pos: int, inputs: Mapping[str, Any] | None = None, rows: int = 1
    ) -> Any:
        """The Decoder contract's forward; the image keys among `tokens` need their images in `inputs[IMAGES]`
        (`MissingRequiredInput` naming the vision graph's pixel input otherwise)."""
        assert start_pos == self.kv_len() == self._pos.shape[1], (start_pos, self.kv_len(), self._pos.shape)
        images = {im.serial: im for im in (inputs or {}).get(IMAGES, ())}
        if images:
            self.parts.remember(list(images.values()))
        ids = np.asarray(tokens, dtype=np.int64)
        keyed = ids >= KEY_BASE
        runs: list[tuple[ImageInput, int, int]] = []  # (image, first k, last k + 1) of each run of its keys
        if keyed.any():
            serial, k = np.divmod(ids[keyed] - KEY_BASE, KEY_STRIDE)
            for s, i in zip(serial.tolist(), k.tolist(), strict=True):
                if runs and runs[-1][0].serial == s and runs[-1][2] == i:
                    runs[-1] = (runs[-1][0], runs[-1][1], i + 1)
                else:
                    runs.append((self._image(images, s), i, i + 1))
        embeds = self.parts.embed(np.where(keyed, self._placeholder, ids), self.parts.rows(runs))
        pos, nxt = self._positions(ids, images)
        spec = self.spec
        feed = {k: v for k, v in (inputs or {}).items() if k != IMAGES}
        feed[spec.inputs_embeds_name] = embeds
        if spec.position_ids_name is not None:
            feed[spec.position_ids_name] = pos[:, None, :]
        out = self.inner.forward(tokens, start_pos, feed, rows)
        self._pos = np.concatenate([self._pos, pos], axis=1)
        self._next = nxt
        return out

    def _image(self, images: Mapping[int, ImageInput], serial: int) -> ImageInput:
        img = images.get(serial)
        if img is None:
            raise MissingRequiredInput(
                self.parts.mm.vision.pixel_values,
                "the prompt holds an image's tokens but the request does not carry that image: pass it "
                "(generate(..., images=[...]) or an image content part)",
            )
        return img

    def _positions(self, ids: np.ndarray, images: Mapping[int, ImageInput]) -> tuple[np.ndarray, int]:
        """`[3, n]` MRoPE positions of `ids` after the cached context, and the next text position."""
        n0, n = self._pos.shape[1], len(ids)
        out = np.empty((3, n), dtype=np.int64)
        nxt = self._next
        for j, t in enumerate(ids.tolist()):
            if t < KEY_BASE:
                out[:, j] = nxt
                nxt += 1
                continue
            serial, k = split_key(t)  # type: ignore[misc]
            img = self._image(images, serial)
            _, gh, gw = img.llm_grid
            first = j - k  # the image's first token, in this forward (>= 0) or in the cache
            p0 = nxt if k == 0 else int(out[0, first] if first >= 0 else self._pos[0, n0 + first])
            ti, r = divmod(k, gh * gw)
            out[:, j] = (p0 + ti, p0 + r // gw, p0 + r % gw)
            nxt = p0 + max(gh, gw) if k == img.tokens - 1 else max(nxt, int(out[:, j].max()) + 1)
        return out, nxt
