"""Images in a token sequence: what the engine hands the decoder, and how an image's tokens are named.

Two different images expand to the same placeholder ids (`<|image_pad|>` x N), so token ids alone cannot say
what a context holds. onnxgen therefore names each placeholder position by its image: the k-th token of the
image with serial s is the *image key* `KEY_BASE + s * KEY_STRIDE + k`, an int far outside any vocabulary.
A request's ids carry these keys where its images are (`Request.prompt`), so everything that compares
contexts by their ids (a slot's longest common prefix, the paged prefix index, sessions) compares images at
their positions too: the same image at the same position matches, a different image never does
(docs/reuse.md, invariant 4). Serials are given per image content digest by the engine (one process: keys
are never saved, `kv.files` refuses them). Whatever reads ids as text (tokenizer, sampling penalties) gets
`unkey(ids, image_token_id)`: the placeholders back.

`ImageInput` is one preprocessed image of a request: its content digest, serial, `pixel_values` and grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

IMAGES = (
    "onnxgen.images"  # the key of a request's images in the inputs a decoder is fed (a tuple of ImageInput)
)
KEY_BASE = 1 << 40  # above every vocabulary
KEY_STRIDE = 1 << 24  # tokens one image may expand to, at most
MAX_SERIAL = 1 << 30  # keys stay below 2**62 (int64 everywhere)


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image. `digest`: blake2b-128 of its pixel values and grid (what its KV depends on);
    `serial`: the engine's number for that digest (its keys' prefix); `pixel_values`: `[patches, patch_dim]`
    float32 (numpy); `grid`: (t, h, w) in patches; `tokens`: how many placeholder tokens it expands to
    (`t * h * w / merge^2`); `llm_grid`: (t, h / merge, w / merge), the layout of those tokens."""

    digest: bytes
    serial: int
    pixel_values: Any = field(repr=False, compare=False)
    grid: tuple[int, int, int]
    merge: int

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        t, h, w = self.grid
        return t, h // self.merge, w // self.merge

    @property
    def tokens(self) -> int:
        t, h, w = self.llm_grid
        return t * h * w


def image_key(serial: int, k: int) -> int:
    """The id of the k-th placeholder token of the image with `serial`."""
    assert 0 <= k < KEY_STRIDE and 0 <= serial < MAX_SERIAL, (serial, k)
    return KEY_BASE + serial * KEY_STRIDE + k


def split_key(token: int) -> tuple[int, int] | None:
    """(serial, k) of an image key; None for an ordinary token id."""
    if token < KEY_BASE:
        return None
    serial, k = divmod(token - KEY_BASE, KEY_STRIDE)
    return serial, k


def has_keys(ids: Sequence[int]) -> bool:
    """Whether `ids` hold any image key."""
    return bool(ids) and max(ids) >= KEY_BASE


def unkey(ids: Sequence[int], image_token_id: int) -> list[int]:
    """`ids` with every image key replaced by the placeholder token id (what a tokenizer reads)."""
    return [image_token_id if t >= KEY_BASE else t for t in ids]


def key_images(ids: Sequence[int], image_token_id: int, images: Sequence[ImageInput]) -> list[int]:
    """`ids` (placeholders expanded: each image's `tokens` placeholder ids in a row, images in order) with the
    placeholders replaced by the images' keys. Raises ValueError when the placeholders and images disagree."""
    out = list(ids)
    it = iter(images)
    img: ImageInput | None = None
    k = 0
    for i, t in enumerate(out):
        if t == image_token_id:
            if img is None or k == img.tokens:
                img, k = next(it, None), 0
                if img is None:
                    raise ValueError("more image placeholders than images")
            out[i] = image_key(img.serial, k)
            k += 1
        elif img is not None:
            if k != img.tokens:
                raise ValueError(f"image {img.serial} was cut short at token {i}")
            img = None
    if img is not None and k != img.tokens:
        raise ValueError(f"image {img.serial} was cut short at the end of the prompt")
    if next(it, None) is not None:
        raise ValueError("more images than placeholders")
    return out
