"""A TCP proxy on loopback that passes bytes at a set rate, so a transfer lasts long enough to be
watched (a pull's progress in /status) without a big file.

    with Throttle("127.0.0.1:5000", bytes_per_second=256 * 1024) as proxy:
        pull(f"oci://{proxy.host}/models/tiny:v1")
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType

CHUNK = 16 * 1024


class Throttle:
    def __init__(self, upstream: str, bytes_per_second: float) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._rate = bytes_per_second
        self._server = socket.create_server(("127.0.0.1", 0))
        self.host = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="throttle-accept").start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self._rate), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, dest: socket.socket, rate: float | None) -> None:
        started, sent = time.monotonic(), 0
        try:
            while chunk := source.recv(CHUNK):
                dest.sendall(chunk)
                sent += len(chunk)
                if rate:
                    ahead = sent / rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dest.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> Throttle:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
