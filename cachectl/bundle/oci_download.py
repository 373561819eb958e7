"""A bundle blob as it arrives: install reads it while a thread takes it off the socket and
hashes it, never more than its declared size plus one byte."""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable
from typing import Any

import requests
import urllib3

from cachectl.bundle.format import BadBundle
from cachectl.bundle.oci_artifact import Reference
from cachectl.bundle.oci_transport import overdue

_QUEUED = 32  # chunks of 1 MiB read off the socket but not yet by install: its memory bound


class Download:
    """A blob's bytes, read by install while a thread takes them off the socket and hashes them:
    the download and the install overlap (the socket's reads, the hash and zstd release the
    GIL). Never more than ``size`` bytes are taken; ``finish`` waits for the last and raises
    unless the whole blob matches its digest, so install publishes nothing before that."""

    def __init__(
        self,
        ref: Reference,
        response: Any,
        digest: str,
        size: int,
        unreachable: Callable[[Exception], Exception],
    ) -> None:
        self.size = size
        self._ref, self._response, self._digest = ref, response, digest
        self._unreachable = unreachable
        self._chunks: queue.Queue[bytes | None] = queue.Queue(_QUEUED)  # None: the end
        self._buf, self._at = b"", 0
        self._ended = False
        self._error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="cachectl-pull", daemon=True)
        self._thread.start()

    def _put(self, chunk: bytes | None) -> bool:
        while not self._stop.is_set():
            try:
                self._chunks.put(chunk, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _pump(self) -> None:
        h, got, ref, raw = hashlib.sha256(), 0, self._ref, self._response.raw
        try:
            # What has arrived, up to 1 MiB (iter_content waits for a whole chunk), and never
            # more than one byte past the declared size; an urllib3 before 2.1 has no read1.
            read1 = getattr(raw, "read1", None)
            while chunk := (
                read1(min(1 << 20, self.size + 1 - got), decode_content=True)
                if read1
                else raw.read(min(64 << 10, self.size + 1 - got), decode_content=True)
            ):
                got += len(chunk)
                if got > self.size:
                    raise BadBundle(
                        f"{ref}: the bundle blob is longer than its manifest says "
                        f"({self.size} bytes; tampered or damaged in the registry): nothing "
                        "installed"
                    )
                h.update(chunk)
                if not self._put(chunk):
                    return
            if overdue(self._response):
                raise requests.exceptions.ReadTimeout("the deadline passed")
            if got != self.size or "sha256:" + h.hexdigest() != self._digest:
                raise BadBundle(
                    f"{ref}: the bundle blob does not match its digest {self._digest[:19]} "
                    "(tampered or damaged in the registry): nothing installed"
                )
        except (requests.exceptions.ReadTimeout, urllib3.exceptions.ReadTimeoutError) as exc:
            self._error = self._unreachable(requests.exceptions.ReadTimeout(exc))
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            cut = requests.exceptions.ReadTimeout if overdue(self._response) else None
            self._error = self._unreachable((cut or requests.exceptions.ConnectionError)(exc))
        except Exception as exc:  # noqa: BLE001 - raised in the reading thread
            self._error = exc
        finally:
            self._response.close()
            self._put(None)  # after _error is set: the reader sees both

    def _next(self) -> bool:
        """The next chunk into the buffer; False at the end (raising the download's error)."""
        if not self._ended:
            chunk = self._chunks.get()
            if chunk is None:
                self._ended = True
            else:
                self._buf, self._at = chunk, 0
                return True
        if self._error is not None:
            raise self._error
        return False

    def read(self, n: int = -1) -> bytes:
        if self._at >= len(self._buf) and not self._next():
            return b""
        if n is None or n < 0:
            n = len(self._buf) - self._at
        data = self._buf[self._at : self._at + n]
        self._at += len(data)
        return data

    def peek(self, n: int = 0) -> bytes:
        if self._at >= len(self._buf) and not self._next():
            return b""
        return self._buf[self._at :]

    def finish(self) -> None:
        """Read to the end (what install did not need of it too), then the download's verdict."""
        self._buf, self._at = b"", 0
        while self._next():
            self._buf, self._at = b"", 0

    def stop(self) -> None:
        """Stop the download (an install that ended without reading it all). A thread still in
        a socket read ends at its timeout (a daemon: it never holds the process up); after
        ``finish`` it has ended already."""
        self._stop.set()
        self._thread.join(timeout=1)
