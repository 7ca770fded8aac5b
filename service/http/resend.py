"""Whether the request on a held connection is the refused one sent again, or a new one. Pure: no I/O.

The pace (service.batching.admission.Pace) counts demand: every new request,
admitted or refused. A client that resends the refused request adds none,
and counting its resend again would make a closed loop whose clients retry
look like demand outrunning the answers. But the next request on a
connection held after a refusal (service.host.hold) is not always a resend:
an open-loop client's pool reuses the connection freed last for its next
request, and through a proxy the connection carries other clients'
requests. Counted as resends, those new requests went missing from the
demand: at twice the capacity of the development machine a worker read its
demand as flat within 10 to 15 s, took it for a closed loop, admitted up to
the deadline, and its accepted requests waited 2.5 to 4 s against the 2 s
budget (docs/overload.md).

So a refused request that is held leaves a digest of its body on its
connection (set here when the route read the body, or by service.http.linger
as it drains an unread one), and the request read after the hold is a
resend only if its body has the same digest. A client that retries sends
the same request again (the openai SDK, wrk, an indexing job's retry loop);
a new request differs. Where no digest was left (a body not drained to its
end, or none), the request is taken for a resend, as every one was before.
"""

from __future__ import annotations

import hashlib

# The body the route read, for the digest of a refused request's (ask_to_hold).
BODY_ENVIRON_KEY = "serve.body"
# Set on a refused request that is held: its body's digest, for its connection to keep.
REFUSED_DIGEST_ENVIRON_KEY = "serve.refused_digest"
# Set by the worker on the request it reads after a hold: the refused one's digest, if known.
HELD_DIGEST_ENVIRON_KEY = "serve.held_digest"

# Enough that two different bodies never collide in practice; blake2b reads
# about a gigabyte a second, so a body of ordinary texts costs microseconds.
DIGEST_BYTES = 16


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def digester() -> hashlib.blake2b:
    """An incremental digest, for a body read in chunks; ``.digest()`` equals ``digest`` of the whole."""
    return hashlib.blake2b(digest_size=DIGEST_BYTES)


def note_refused_body(environ: dict[str, object]) -> None:
    """A held refusal of a request whose body was read: leave its digest for the connection."""
    body = environ.get(BODY_ENVIRON_KEY)
    if isinstance(body, bytes):
        environ[REFUSED_DIGEST_ENVIRON_KEY] = digest(body)


def is_resend(held_digest: object, body: bytes) -> bool:
    """Whether a request read after a hold, of ``body``, is the refused request sent again.

    ``held_digest``: the refused request's digest its connection kept (None: unknown,
    and the request is taken for a resend).
    """
    if not isinstance(held_digest, bytes):
        return True
    return digest(body) == held_digest
