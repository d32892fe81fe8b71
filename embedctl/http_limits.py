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
        self._head_tail = b""  # the last bytes of the head so far, for a blank line split across reads
        self._in_head = True  # until the first head is whole: a connection that sends nothing is timed too
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head and not self.transport.is_closing():
            # Counted before the parser sees the data, so that a head ending in this read is refused, not served.
            self._head_bytes += self._head_share(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request line and headers are larger than {self.max_head_bytes >> 10} KiB")
                return
        super().data_received(data)

    def _head_share(self, data: bytes) -> int:
        """How many bytes of data belong to the head being read: up to its blank line, or all of them. The head
        after a message that ends within a read is counted from the next read on (pipelined requests), a leeway
        of one read (256 KiB at most); counting a body with its head refused every request of over 64 KiB."""
        seen = self._head_tail + data
        if not self._head_tail and self._head_bytes == 0:  # empty lines before a request line are not its end
            seen = seen.lstrip(b"\r\n")
        ends = [seen.find(blank) + len(blank) for blank in (b"\r\n\r\n", b"\n\n") if blank in seen]
        if ends:
            return min(ends) - len(self._head_tail)  # past the tail: a blank line in it would have ended the head
        self._head_tail = seen[-3:]
        return len(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes, self._head_tail = 0, b""
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # the next request's head may start in the data that ended this one
        self._head_bytes, self._head_tail = 0, b""

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
