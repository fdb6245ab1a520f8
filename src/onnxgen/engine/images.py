"""A request's images: decoded, preprocessed per the package's `processor_config.json`, digested, numbered.

    images = ImageInputs(spec.multimodal.processor, merge)
    messages, sources = images.split_messages(messages)   # image content parts -> placeholders + their data
    inputs = [images.prepare(src) for src in sources]      # ImageInput: digest, serial, pixel_values, grid

Sources: encoded image bytes (PNG, JPEG, ... decoded by Pillow), a `data:` URL, a `PIL.Image`, or an
`[H, W, 3]` uint8 array. Remote URLs are never fetched here (the server fetches them when its operator allows
it). Preprocessing is Qwen2.5-VL's: RGB, a bicubic resize (Pillow's) to the "smart" size (sides multiples of
patch x merge, pixel count within the config's bounds, aspect kept), `x * rescale`, `(x - mean) / std` per
channel (numpy, float32), then patches of `temporal_patch_size` copies of `patch_size`^2 pixels laid out
merge block by merge block (`[patches, 3 * T * P * P]`), as transformers' Qwen2-VL image processor does.

An image's digest is blake2b-128 over its grid and pixel values (what its KV depends on); its serial, the
number its placeholder keys carry (`package/attachments.py`), is given once per digest by the engine's
`ImageInputs` (least recently used digests forgotten past `max_known`: such an image gets a new serial next
time and reuses nothing, never a wrong context).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnxgen.errors import InvalidRequest, MissingRequiredInput
from onnxgen.package.attachments import MAX_SERIAL, ImageInput
from onnxgen.package.multimodal import ProcessorSpec

IMAGE_PART_TYPES = ("image", "image_url", "input_image")


def smart_size(height: int, width: int, proc: ProcessorSpec) -> tuple[int, int]:
    """Qwen2-VL's resize target: sides multiples of `proc.factor`, pixels within [min, max], aspect kept."""
    f = proc.factor
    if max(height, width) / max(1, min(height, width)) > 200:
        raise InvalidRequest(f"image aspect ratio {width}x{height} is over 200", field="images")
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > proc.max_pixels:
        beta = math.sqrt(height * width / proc.max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < proc.min_pixels:
        beta = math.sqrt(proc.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def decode_image(source: Any) -> Any:
    """A `PIL.Image` in RGB from bytes, a data: URL, a PIL image or an `[H, W, 3]` uint8 array. Raises
    `InvalidRequest` (field "images") for anything else, an undecodable file, or a remote URL."""
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - the vision extra is missing
        raise InvalidRequest(
            f"images need Pillow ({exc}): pip install 'onnxgen[vision]'", field="images"
        ) from exc
    if isinstance(source, str):
        source = data_url_bytes(source)
    if isinstance(source, bytes | bytearray | memoryview):
        try:
            img = Image.open(io.BytesIO(bytes(source)))
            img.load()
        except Exception as exc:  # Pillow raises many types for a bad file
            raise InvalidRequest(f"an image could not be decoded ({exc})", field="images") from exc
    elif isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or source.ndim != 3 or source.shape[2] not in (3, 4):
            raise InvalidRequest("an image array must be [height, width, 3] uint8", field="images")
        img = Image.fromarray(source)
    elif isinstance(source, Image.Image):
        img = source
    else:
        raise InvalidRequest(
            f"an image must be bytes, a data: URL, a PIL image or a uint8 array, got {type(source).__name__}",
            field="images",
        )
    return img if img.mode == "RGB" else img.convert("RGB")


def data_url_bytes(url: str) -> bytes:
    """The bytes of a base64 `data:` URL. Raises `InvalidRequest` for other URLs (remote ones included)."""
    if not url.startswith("data:"):
        kind = (
            "remote image URLs are not fetched"
            if url.startswith(("http://", "https://"))
            else "not a data: URL"
        )
        raise InvalidRequest(f"{kind}: pass the image's bytes or a base64 data: URL", field="images")
    head, _, payload = url.partition(",")
    if not head.endswith(";base64"):
        raise InvalidRequest("a data: URL image must be base64-encoded", field="images")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise InvalidRequest(f"a data: URL holds invalid base64 ({exc})", field="images") from exc


def preprocess(img: Any, proc: ProcessorSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """`(pixel_values [patches, patch_dim] float32, grid (t, h, w) in patches)` of an RGB PIL image."""
    from PIL import Image

    h, w = smart_size(img.height, img.width, proc)
    if (h, w) != (img.height, img.width):
        img = img.resize((w, h), Image.Resampling.BICUBIC)
    x = np.asarray(img, dtype=np.float32) * np.float32(proc.rescale_factor)
    x = (x - np.asarray(proc.mean, np.float32)) / np.asarray(proc.std, np.float32)
    p, m, t = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    gh, gw = h // p, w // p
    x = x.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * t * p * p), dtype=np.float32), (1, gh, gw)


def image_digest(pixel_values: np.ndarray, grid: tuple[int, int, int]) -> bytes:
    """blake2b-128 over the grid and the pixel values."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"image\x00" + repr(tuple(grid)).encode() + b"\x00" + str(pixel_values.dtype).encode())
    h.update(np.ascontiguousarray(pixel_values).tobytes())
    return h.digest()


class ImageInputs:
    """One engine's images: preprocessing for its package and the serial of each digest. Thread-safe."""

    def __init__(self, proc: ProcessorSpec, max_known: int = 1 << 16) -> None:
        self.proc = proc
        self.max_known = max_known
        self._serials: OrderedDict[bytes, int] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()

    def serial(self, digest: bytes) -> int:
        """The serial of `digest` (a new one the first time, or after it was forgotten)."""
        with self._lock:
            s = self._serials.get(digest)
            if s is None:
                s, self._next = self._next, self._next + 1
                assert s < MAX_SERIAL, "image serials exhausted"
                self._serials[digest] = s
                if len(self._serials) > self.max_known:
                    self._serials.popitem(last=False)
            else:
                self._serials.move_to_end(digest)
            return s

    def prepare(self, source: Any) -> ImageInput:
        """Decode, preprocess, digest and number one image source. Raises `InvalidRequest`."""
        pixels, grid = preprocess(decode_image(source), self.proc)
        digest = image_digest(pixels, grid)
        return ImageInput(digest, self.serial(digest), pixels, grid, self.proc.merge_size)


def split_messages(
    messages: Sequence[Mapping[str, Any]], given: Sequence[Any]
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Messages whose image content parts are reduced to `{"type": "image"}` (what a chat template renders as a
    placeholder), and the image sources in prompt order: a part's own data (`image`, `image_url` as a string
    or `{"url": ...}`), else the next of `given` (`generate(..., images=[...])`). Sources of `given` left over
    follow. Raises `InvalidRequest` for a part with an unusable source."""
    rest = list(given)[::-1]
    sources: list[Any] = []
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(dict(m))
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in IMAGE_PART_TYPES and not (
                isinstance(part, Mapping) and ("image" in part or "image_url" in part)
            ):
                parts.append(part)
                continue
            src = part.get("image", part.get("image_url"))
            if isinstance(src, Mapping):
                src = src.get("url")
            if src is None:
                if not rest:
                    sources.append(None)  # a placeholder without an image: the caller's MissingRequiredInput
                    parts.append({"type": "image"})
                    continue
                src = rest.pop()
            elif isinstance(src, str) and not src.startswith("data:"):
                raise InvalidRequest(
                    f"messages[{i}]: an image part's URL must be a data: URL here (remote URLs are not fetched)",
                    field="messages",
                )
            sources.append(src)
            parts.append({"type": "image"})
        out.append({**m, "content": parts})
    return out, sources + rest[::-1]


def check_count(found: int, given: int, pixel_input: str) -> None:
    """Raise for a prompt whose `found` image placeholders do not match its `given` images: fewer images is a
    `MissingRequiredInput` naming the vision graph's `pixel_input`, more is an `InvalidRequest`."""
    if given < found:
        raise MissingRequiredInput(
            pixel_input,
            f"the prompt has {found} image placeholder(s) but {given} image(s) came with it: pass each image "
            "(generate(..., images=[...]) or an image content part with its data)",
        )
    if given > found:
        raise InvalidRequest(
            f"{given} images came with a prompt that has {found} image placeholder(s)", field="images"
        )


def expand_text(text: str, pad: str, images: Sequence[ImageInput]) -> str:
    """`text` with its i-th `pad` repeated `images[i].tokens` times (the count was checked)."""
    pieces = text.split(pad)
    assert len(pieces) == len(images) + 1, (len(pieces), len(images))
    out = [pieces[0]]
    for im, piece in zip(images, pieces[1:], strict=True):
        out += [pad * im.tokens, piece]
    return "".join(out)


def expand_ids(
    ids: Sequence[int], pad_id: int, images: Sequence[ImageInput], pixel_input: str = "pixel_values"
) -> list[int]:
    """Token ids whose placeholders stand one per image (each becomes `tokens` of them) or are already
    expanded (kept). Raises `MissingRequiredInput` / `InvalidRequest` when they fit neither."""
    found = sum(1 for t in ids if t == pad_id)
    if found == sum(im.tokens for im in images) and images:
        return list(ids)
    runs = sum(1 for i, t in enumerate(ids) if t == pad_id and (i == 0 or ids[i - 1] != pad_id))
    check_count(runs, len(images), pixel_input)
    out: list[int] = []
    it = iter(images)
    for i, t in enumerate(ids):
        if t != pad_id:
            out.append(t)
        elif i == 0 or ids[i - 1] != pad_id:
            out += [pad_id] * next(it).tokens
    return out
