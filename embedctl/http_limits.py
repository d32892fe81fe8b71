"""uvicorn's httptools protocol with limits on a request's head (request line and headers), which it lacks.

uvicorn's h11 protocol caps a head at 16 KiB; its httptools one, which serve runs for its speed, reads a
head of any size for as long as the client takes: one unauthenticated connection sending 200 MB of a
header grew the server by 300 MB, and one that sends half a head and stops held its connection, and a
shutdown's drain, for ever. Servers such as hyper (under TEI) or nginx answer both, as this does: a head
past MAX_HEAD_BYTES gets 431, one not whole HEAD_TIMEOUT_SECONDS after its first byte (or after the
connection opened) gets 408, each with the connection closed. The body has serve's own limits.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Twice nginx's largest default head (four 8 KiB buffers) and four times h11's: room for long cookies and tokens.
MAX_HEAD_BYTES = 64 << 10
HEAD_TIMEOUT_SECONDS = 30  # as hyper's header_read_timeout


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that refuses a head larger than max_head_bytes or slower than head_timeout seconds."""

    max_head_bytes = MAX_HEAD_BYTES
    head_timeout = HEAD_TIMEOUT_SECONDS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._in_head = True  # until the first head is whole: a connection that sends nothing is timed too
        self._boundaries = 0  # heads and messages the parser has seen end
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        boundaries = self._boundaries
        super().data_received(data)
        if not self._in_head or self.transport.is_closing():
            return
        if self._boundaries != boundaries:
            # A head or a message ended within this data (a body can arrive with its head, in one read): the
            # next head's share of it is not known, so it counts from the next read on, one read (256 KiB at
            # most) of leeway. Counting the whole read refused every request with a body over 64 KiB.
            self._head_bytes = 0
            return
        self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes:
            self._refuse(431, "Request Header Fields Too Large",
                         f"the request line and headers are larger than {self.max_head_bytes >> 10} KiB")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._boundaries += 1
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # the next request's head may start in the data that ended this one
        self._head_bytes = 0
        self._boundaries += 1

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._refuse(408, "Request Timeout",
                         f"the request line and headers did not arrive within {self.head_timeout} s")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """A plain-text error and the connection closed: no request was made of the head, so no app sees it."""
        self._in_head = False
        self._stop_head_timer()
        body = message.encode("ascii")
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, reason.encode("ascii"), len(body), body))
        self.transport.close()
