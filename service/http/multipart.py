"""``multipart/form-data`` bodies to image items, one a part, in order. Pure: no Flask.

The body is already read and bounded (SERVE_MAX_BODY_BYTES); werkzeug's
sans-I/O decoder splits it, told to stop after one part more than a request
may hold (SERVE_MAX_ITEMS_PER_REQUEST), so that a body of thousands of tiny
parts costs no more than a refusal. Every part is an image, whatever its field
name (``curl -F image=@a.jpg -F image=@b.jpg``); a part that declares a
Content-Type must declare an image or ``application/octet-stream``.
"""

from __future__ import annotations

from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import Data, Epilogue, Field, File, MultipartDecoder, NeedData

from service.errors import BadRequest, InvalidInput, PayloadTooLarge, UnsupportedMediaType

MULTIPART = "multipart/form-data"
_PART_TYPES = ("image/", "application/octet-stream")
# A boundary is 1 to 70 characters (RFC 2046).
_MAX_BOUNDARY = 70


def parse_parts(body: bytes, content_type: str, max_items: int) -> list[bytes]:
    """Each part's bytes; BadRequest for a malformed body, 413 for too many parts, 415 for a text part."""
    _, options = parse_options_header(content_type)
    boundary = options.get("boundary", "")
    if not boundary or len(boundary) > _MAX_BOUNDARY:
        raise BadRequest(f"{MULTIPART} needs a boundary parameter of 1 to {_MAX_BOUNDARY} characters")
    decoder = MultipartDecoder(boundary.encode("latin-1", "replace"), max_parts=max_items)
    decoder.receive_data(body)
    decoder.receive_data(None)
    parts: list[bytearray] = []
    try:
        while True:
            event = decoder.next_event()
            if isinstance(event, (Field, File)):
                _check_part_type(event, len(parts))
                parts.append(bytearray())
            elif isinstance(event, Data):
                parts[-1] += event.data
            elif isinstance(event, Epilogue):
                break
            elif isinstance(event, NeedData):  # the decoder saw the whole body and wants more
                raise ValueError("the body ends before its closing boundary")
    except RequestEntityTooLarge:
        raise PayloadTooLarge(
            f"the {MULTIPART} body holds more than {max_items} parts; "
            f"the limit is {max_items} images (SERVE_MAX_ITEMS_PER_REQUEST)"
        ) from None
    except (UnsupportedMediaType, InvalidInput):
        raise
    except Exception as exc:
        # werkzeug's decoder raises ValueError, UnicodeDecodeError or worse on a
        # malformed body: whatever it is, the body is the client's to fix.
        raise BadRequest(
            f"the {MULTIPART} body is malformed: {str(exc)[:200] or type(exc).__name__}"
        ) from None
    if not parts:
        raise InvalidInput(f"the {MULTIPART} body holds no parts; send one image a part")
    return [bytes(part) for part in parts]


def _check_part_type(event: Field | File, index: int) -> None:
    declared = event.headers.get("Content-Type")
    if declared is None:
        return
    mimetype = declared.split(";", 1)[0].strip().lower()
    if not mimetype.startswith(_PART_TYPES):
        raise UnsupportedMediaType(
            f"part {index} ({event.name!r}) is {mimetype}; each part must be an image "
            "(image/jpeg, image/png, image/webp) or application/octet-stream"
        )
