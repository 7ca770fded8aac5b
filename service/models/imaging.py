"""Image items: decoded and preprocessed in the request thread, with Pillow, bounded.

Public, so that a factory model takes images the way a model directory does:

    from service.config.image_spec import ImageSpec
    from service.models.imaging import ImagePreprocessor

    preprocess = ImagePreprocessor(ImageSpec(resize=256, center_crop=224, mean=[...], std=[...]))
    array = preprocess(item)  # float32, (channels, height, width); in prepare

An item is the encoded file: bytes (a raw body, a multipart part, an OIP v2
BYTES element) or a string of base64, a ``data:`` URI included (JSON). Only
JPEG, PNG and WebP are opened, one frame each: a file is refused before any
pixel is decoded when its header says it is too large (SERVE_MAX_IMAGE_PIXELS,
under Pillow's own decompression-bomb guard), empty, or animated. Every
refusal names the problem: 413 too many pixels, 415 another image format
(HEIC and AVIF from phones included, with the formats that are served),
422 (ValueError) anything undecodable. A worker decodes at most
DECODES_AT_ONCE images of the pixel limit at once (smaller ones by their
pixels), so that many large photos arriving together wait rather than
exhaust its memory. Pillow releases the GIL while it
decodes and resizes, so request threads preprocess in parallel and the batch
thread only stacks and runs.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from service.config.budget import Budget
from service.config.image_spec import ImageSpec
from service.errors import PayloadTooLarge, ServeError, UnsupportedMediaType, json_type

__all__ = ["DEFAULT_MAX_PIXELS", "IMAGE_TYPES", "ImageError", "ImagePreprocessor", "image_bytes"]

# What SERVE_MAX_IMAGE_PIXELS defaults to; a factory may pass its own.
DEFAULT_MAX_PIXELS = 4096 * 4096
# The formats decoded, by Pillow's names, and their media types. Opening no
# others keeps the dozens of rarely used decoders Pillow ships out of reach.
FORMATS = ("JPEG", "PNG", "WEBP")
IMAGE_TYPES = {"image/jpeg": "JPEG", "image/png": "PNG", "image/webp": "WEBP"}
# Other image formats recognised by their first bytes, so that the client hears what it sent.
_OTHER_SIGNATURES = {
    b"GIF87a": "GIF",
    b"GIF89a": "GIF",
    b"BM": "BMP",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
    b"\x00\x00\x01\x00": "ICO",
    b"8BPS": "PSD",
}
# ISO base media files (HEIC from an iPhone's camera, AVIF) by the brands in
# their ftyp box: phones send them, and this service decodes neither.
_HEIF_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs", b"mif1", b"msf1"}
_AVIF_BRANDS = {b"avif", b"avis"}
# Images of SERVE_MAX_IMAGE_PIXELS one worker decodes at once (smaller ones
# count by their pixels): each is width x height x 4 bytes once decoded, and
# again as it is converted, so a worker of 72 request threads would otherwise
# hold gigabytes while dozens of photos decode.
DECODES_AT_ONCE = 2
_RESAMPLING = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


# What every 415 for an image says: the formats that are served.
SERVED = "this model takes JPEG, PNG or WebP (image/jpeg, image/png, image/webp)"
_CONVERT_HINT = {
    "HEIC": "; convert it first (an iPhone saves JPEG with Settings > Camera > Formats > Most Compatible)",
    "HEIF": "; convert it to JPEG first",
    "AVIF": "; convert it to JPEG or WebP first",
}


class ImageError(ValueError):
    """An image that cannot be served (422): undecodable, truncated, empty or animated."""


def image_bytes(item: Any) -> bytes:
    """An item's encoded file: bytes as they are, a base64 string or ``data:`` URI decoded."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if not isinstance(item, str):
        raise ImageError(f"expected an image: a base64 string or a data: URI, got {json_type(item)}")
    text = item
    if text.startswith("data:"):
        header, comma, text = text.partition(",")
        media_type = header[5:].split(";", 1)[0].strip().lower()
        if not comma or not header.endswith(";base64"):
            raise ImageError("a data: URI must be data:image/<type>;base64,<data>")
        if media_type not in IMAGE_TYPES:
            raise UnsupportedMediaType(
                f"the data: URI's type is {media_type or 'none'}; images are {', '.join(IMAGE_TYPES)}"
            )
    try:
        # Line breaks are common in base64 from mail-era encoders; anything else invalid is refused.
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image is not valid base64 (send the file's bytes as standard base64)") from None


def sniff(data: bytes) -> str | None:
    """The image format that ``data``'s first bytes announce, by Pillow's name; None if unknown."""
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[4:8] == b"ftyp":
        return _iso_media_format(data)
    return next((name for magic, name in _OTHER_SIGNATURES.items() if data.startswith(magic)), None)


def _iso_media_format(data: bytes) -> str | None:
    """HEIC, HEIF or AVIF, from an ISO base media file's ftyp box: its major and compatible brands."""
    size = int.from_bytes(data[:4], "big")
    box = data[8 : min(max(size, 16), 256)]
    # The major brand, a minor version, then the compatible brands.
    brands = {box[:4]} | {box[i : i + 4] for i in range(8, len(box) - 3, 4)}
    if brands & _AVIF_BRANDS:
        return "AVIF"
    if brands & _HEIF_BRANDS:
        return "HEIC" if brands & (_HEIF_BRANDS - {b"mif1", b"msf1"}) else "HEIF"
    return None


class ImagePreprocessor:
    """Decodes one image and preprocesses it as an :class:`ImageSpec` declares: the model's input array."""

    def __init__(self, spec: ImageSpec, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        self.spec = spec
        self.max_pixels = max_pixels
        self.input_shape = spec.input_shape
        # Pixels this preprocessor's request threads decode at once (one per worker, as the model is).
        self._decoding = Budget(DECODES_AT_ONCE * max_pixels)
        channels = self.input_shape[0]
        # Shaped to broadcast over height x width x channels, in float32 as torchvision's Normalize.
        self._mean = np.resize(np.asarray(spec.mean, dtype=np.float32), channels)
        self._std = np.resize(np.asarray(spec.std, dtype=np.float32), channels)

    def __call__(self, item: Any) -> np.ndarray:
        data = image_bytes(item)
        # Held from the decode until the model's small array is made: the decoded
        # image lives until the resize.
        with self._decoding.hold(self._pixels(data)):
            return self.transform(self.decode(data))

    def _pixels(self, data: bytes) -> int:
        """The pixels the file's header announces, within the limit; 0 for a file decode() will refuse."""
        if sniff(data) not in FORMATS:
            return 0
        try:
            with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                width, height = image.size
        except Exception:  # decode() reads the same header and says what is wrong with it
            return 0
        return max(0, min(width * height, self.max_pixels))

    def decode(self, data: bytes) -> Image.Image:
        """One frame of ``data``, loaded, in the declared channels' mode (RGB for BGR)."""
        if not data:
            raise ImageError("the image is empty (0 bytes)")
        found = sniff(data)
        if found not in FORMATS:
            if found is not None:
                raise UnsupportedMediaType(f"the image is {found}; {SERVED}{_CONVERT_HINT.get(found, '')}")
            raise ImageError("the data is not a JPEG, PNG or WebP image (its first bytes are none of theirs)")
        try:
            with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                self._check(image)
                image.load()
                return image.convert("L" if self.spec.channels == "L" else "RGB")
        except (ServeError, ImageError):
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            # Pillow's guard, which fires inside open before our own limit is read
            # (the warning is an error wherever warnings are, as in the tests).
            raise PayloadTooLarge(
                "the image's header claims more pixels than Pillow's decompression-bomb guard allows; "
                + self._too_large_message()
            ) from None
        except UnidentifiedImageError:
            raise ImageError(
                f"the {found} image's header cannot be read: the file is corrupt, truncated or of zero size"
            ) from None
        except Exception as exc:
            # Whatever a decoder raises on a hostile file (OSError for a
            # truncated one, SyntaxError, struct.error, ValueError, ...) means
            # the file is bad, and the client, not the service, has to fix it.
            raise ImageError(f"the {found} image cannot be decoded: {_reason(exc)}") from None

    def _check(self, image: Image.Image) -> None:
        """Refuse from the header alone, before decoding a pixel."""
        width, height = image.size
        if width < 1 or height < 1:
            raise ImageError(f"the image is {width}x{height} pixels; it has no pixels")
        if width * height > self.max_pixels:
            raise PayloadTooLarge(f"the image is {width}x{height} pixels; " + self._too_large_message())
        frames = getattr(image, "n_frames", 1)
        # A camera's MPO file is a JPEG with extra frames (previews, depth):
        # Pillow loads its first, the photo itself.
        if frames > 1 and image.format != "MPO":
            raise ImageError(f"the image is animated or has {frames} frames; send a single frame")

    def _too_large_message(self) -> str:
        return f"the limit is {self.max_pixels} pixels (width x height, SERVE_MAX_IMAGE_PIXELS)"

    def transform(self, image: Image.Image) -> np.ndarray:
        """A decoded image as the model's float32 input: (channels, height, width)."""
        spec = self.spec
        if spec.channels == "L" and image.mode != "L":
            image = image.convert("L")
        elif spec.channels != "L" and image.mode != "RGB":
            image = image.convert("RGB")
        if spec.resize is not None:
            size = resized(image.size, spec.resize)
            # A long thin image within the pixel limit can ask for a resize
            # far beyond it (16x1,000,000 with its short side scaled to 256 is
            # 4 billion pixels): the limit holds for what the resize makes too.
            if size[0] < 1 or size[1] < 1:
                raise ImageError(
                    f"the image is {image.size[0]}x{image.size[1]} pixels; resized for the model "
                    f"it would have no pixels (its sides are too far apart)"
                )
            if size[0] * size[1] > self.max_pixels:
                raise PayloadTooLarge(
                    f"the image is {image.size[0]}x{image.size[1]} pixels; resized for the model it "
                    f"would be {size[0]}x{size[1]}: " + self._too_large_message()
                )
            if size != image.size:
                image = image.resize(size, _RESAMPLING[spec.interpolation])
        if spec.center_crop is not None:
            image = image.crop(crop_box(image.size, spec.center_crop))
        array = np.asarray(image, dtype=np.float32)
        if array.ndim == 2:
            array = array[:, :, np.newaxis]
        if spec.channels == "BGR":
            array = array[:, :, ::-1]
        array = (array / np.float32(255) - self._mean) / self._std
        return np.ascontiguousarray(array.transpose(2, 0, 1))


def resized(size: tuple[int, int], resize: int | tuple[int, int]) -> tuple[int, int]:
    """The (width, height) ``resize`` asks for, as torchvision's Resize computes it."""
    if isinstance(resize, tuple):
        height, width = resize
        return width, height
    width, height = size
    if width <= height:
        return resize, int(resize * height / width)
    return int(resize * width / height), resize


def crop_box(size: tuple[int, int], crop: tuple[int, int]) -> tuple[int, int, int, int]:
    """The centre crop's box, as torchvision's CenterCrop: an image smaller than it is padded with black."""
    width, height = size
    crop_height, crop_width = crop
    left = _offset(width, crop_width)
    top = _offset(height, crop_height)
    # Pillow fills what lies outside the image with zeros, as torchvision's padding does.
    return left, top, left + crop_width, top + crop_height


def _offset(side: int, crop: int) -> int:
    if crop > side:
        return -((crop - side) // 2)
    return round((side - crop) / 2.0)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text[:200]
