"""An HTTP/1.1 server on loopback that answers from a script: what real S3 servers rarely do
(chunked and close-delimited bodies, dropped keep-alive connections, truncated bodies, silence,
5xx, a 200 that carries an error) on real sockets, for the store's transports."""

import socket
import ssl
import threading
import time
from collections.abc import Callable

Script = Callable[[int, bytes], bytes | None]     # (connection number, request) -> reply; None: close


class ScriptedServer:
    """An HTTP/1.1 server on loopback answering each request with what ``script`` says.

    Counts connections and requests (each with its body, when it has a Content-Length); a reply ending in b"<close>" closes the connection after
    sending the rest; ``b"<silent>"`` sends nothing and waits for the client to hang up; b"<stall>"
    sends the rest and then nothing more; b"<trickle>" sends the rest in 8 pieces 0.1 s apart."""

    def __init__(self, script: Script, tls: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.tls = tls
        self.connections = 0
        self.requests: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            if self.tls is not None:
                try:
                    conn.settimeout(2)
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except (OSError, ssl.SSLError):
                    conn.close()
                    continue
            thread = threading.Thread(target=self._serve, args=(conn, self.connections), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        conn.settimeout(0.2)
        buffer = b""
        with conn:
            while not self._stop.is_set():
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    data = self._receive(conn)
                    if data is None:
                        return
                    buffer += data
                    continue
                request, buffer = buffer[:end + 4], buffer[end + 4:]
                length = _content_length(request)
                while len(buffer) < length:
                    data = self._receive(conn)
                    if data is None:
                        return
                    buffer += data
                request, buffer = request + buffer[:length], buffer[length:]
                self.requests.append(request)
                reply = self.script(number, request)
                if reply is None:
                    return
                if reply == b"<silent>":
                    self._stop.wait(5)
                    return
                close, stall = reply.endswith(b"<close>"), reply.endswith(b"<stall>")
                trickle = reply.endswith(b"<trickle>")
                reply = reply.removesuffix(b"<close>").removesuffix(b"<stall>").removesuffix(b"<trickle>")
                try:
                    if trickle:          # 8 pieces, 0.1 s apart
                        step = -(-len(reply) // 8)
                        for i in range(0, len(reply), step):
                            conn.sendall(reply[i:i + step])
                            time.sleep(0.1)
                    else:
                        conn.sendall(reply)
                except OSError:
                    return          # the client hung up mid-answer (it may: see the range tests)
                if stall:
                    self._stop.wait(5)
                    return
                if close:
                    return

    def _receive(self, conn: socket.socket) -> bytes | None:
        """What the client sent next (b"" after a quiet 0.2 s); None once it hung up or the
        server stops."""
        if self._stop.is_set():
            return None
        try:
            return conn.recv(65536) or None
        except (TimeoutError, ssl.SSLWantReadError):
            return b""
        except OSError:
            return None

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=6)
        self._sock.close()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value)
    return 0
