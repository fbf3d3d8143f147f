"""A response body received straight into the ``bytes`` object the caller gets.

The obvious way, ``bytearray(n)``, ``recv_into`` it, then ``bytes(...)`` of it, writes every byte
three times: the bytearray is zeroed, filled by the kernel, then copied into a new ``bytes``; and
both buffers are often memory the kernel must fault in and clear page by page (up to 1,024 page
faults per 4 MiB buffer; fewer once glibc reuses freed blocks). Measured on the packed mount's
cold epoch (2-CPU VM, 5 rounds each way): the daemon at 0.36-0.41 ms of CPU per file against
0.39-0.48, 18-23 page faults per file against 26-28 (docs/packer.md, "Not yet").

``new(n)`` makes an uninitialised ``bytes`` of ``n`` bytes (``PyBytes_FromStringAndSize(NULL, n)``,
as C extensions build one) and a writable view of its buffer, so the kernel writes each byte once,
into the object that is returned. The bytes object is new and unshared until the view's owner is
done with it; CPython allows exactly this in C (fill a fresh bytes object before it is shared),
and this module does it from Python with ctypes. It is only used on CPython, and only after a
self-check at import; otherwise ``new`` falls back to a bytearray whose ``finish`` copies it.
"""

import ctypes
import platform


def _fresh(length: int) -> tuple[bytes, memoryview]:
    data = _from_string_and_size(None, length)
    address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    window = (ctypes.c_char * length).from_address(address)
    window.owner = data     # the view keeps the bytes alive: it can never outlive them
    return data, memoryview(window).cast("B")


def _fallback(length: int) -> tuple[bytearray, memoryview]:
    buffer = bytearray(length)
    return buffer, memoryview(buffer)


def new(length: int) -> tuple[bytes | bytearray, memoryview]:
    """``(body, view)``: write ``length`` bytes through ``view``, release it, then
    ``finish(body)`` is the bytes. ``length`` must be at least 2 (0 and 1 may be shared objects)."""
    if length < 2:
        raise ValueError("fresh bytes need a length of 2 or more")
    return _new(length)


def finish(body: bytes | bytearray) -> bytes:
    return body if type(body) is bytes else bytes(body)


def _works() -> bool:
    try:
        data, view = _fresh(4096)
        view[:] = bytes(range(256)) * 16
        view.release()
        return type(data) is bytes and data == bytes(range(256)) * 16 and hash(data) == hash(bytes(data))
    except Exception:  # noqa: BLE001 - anything odd: the plain path
        return False


_new = _fallback
if platform.python_implementation() == "CPython":
    try:
        _from_string_and_size = ctypes.pythonapi.PyBytes_FromStringAndSize
        _from_string_and_size.restype = ctypes.py_object
        _from_string_and_size.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    except AttributeError:
        pass
    else:
        if _works():
            _new = _fresh
