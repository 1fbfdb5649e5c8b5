"""Images in chat messages: one canonical form for the Env loop, the gateway and the trainer.

An image part is `{"type": "image", "image": URL}` where URL is a `data:image/...;base64,`
URL (a PIL image given by an Env is encoded to PNG once). Samples carry these URLs, in the
order of their placeholders in the tokens; the engine and the trainer decode the same bytes.
The chat template renders each image part as the model's placeholder
(`<|vision_start|><|image_pad|><|vision_end|>` for Qwen-VL), which the engine expands to
one token per image patch group.
"""

import base64
import binascii
import io
from typing import Any

IMAGE_TOKEN = "<|image_pad|>"
"""The image placeholder of Qwen-VL models: a model whose vocabulary has it takes images."""
MAX_IMAGE_BYTES = 16 << 20
MAX_IMAGE_PIXELS = 4096 * 4096
"""Larger images are refused, checked from the data's length and the image's header before
anything is decoded (a 22 KB PNG can hold 12000 x 12000 pixels)."""


def data_url(image: Any) -> str:
    """A PIL image as a PNG data URL; a data URL is checked (it must decode) and returned."""
    if isinstance(image, str):
        decode(image)
        return image
    if not hasattr(image, "save"):
        raise ValueError(f"an image must be a PIL image or a data: URL, got {type(image).__name__}")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def decode(url: str):
    """The RGB PIL image of a data URL; ValueError (with the reason) if it is not one."""
    from PIL import Image

    head, sep, payload = url.partition(",")
    if not (sep and head.startswith("data:image/") and head.endswith(";base64")):
        raise ValueError("an image must be a base64 data URL (data:image/...;base64,...); "
                         f"got {url[:40]!r} (instar fetches nothing from the network)")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"the image is over {MAX_IMAGE_BYTES >> 20} MB")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))  # (the header)
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ValueError(f"the image has {image.width} x {image.height} pixels, over "
                             f"{MAX_IMAGE_PIXELS}")
        image.load()
    except (binascii.Error, OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"the image data does not decode: {e}") from e
    return image.convert("RGB")


def image_part(image: Any) -> dict:
    return {"type": "image", "image": data_url(image)}


def image_urls(messages: list[dict]) -> list[str]:
    """Data URLs of the image parts of `messages`, in order (PIL images are encoded)."""
    return [data_url(p["image"]) for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"]


def with_images(messages: list[dict], images: list[Any]) -> list[dict]:
    """`messages` with `images` put before the text of the last one."""
    if not images:
        return messages
    *head, last = messages
    text = last.get("content") or ""
    parts = [{"type": "text", "text": text}] if isinstance(text, str) else list(text)
    return [*head, {**last, "content": [image_part(i) for i in images] + parts}]
