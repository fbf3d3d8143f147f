"""The driver's one error type: a gRPC status code name and a one-line message.

Raised by the agent and the services alike; the agent sends ``{"error": {"code", "message"}}`` over
its socket and the plugin raises it again, and one place (``csi.server``) aborts the RPC with it.
Messages never carry secrets.
"""


class CsiError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code          # a grpc.StatusCode name: INVALID_ARGUMENT, NOT_FOUND, ...
        self.message = message


def invalid(message: str) -> CsiError:
    return CsiError("INVALID_ARGUMENT", message)


def not_found(message: str) -> CsiError:
    return CsiError("NOT_FOUND", message)


def already_exists(message: str) -> CsiError:
    return CsiError("ALREADY_EXISTS", message)


def precondition(message: str) -> CsiError:
    return CsiError("FAILED_PRECONDITION", message)


def internal(message: str) -> CsiError:
    return CsiError("INTERNAL", message)


def handled(method):
    """The one place a CsiError becomes a gRPC status (the RPC is aborted with its code)."""
    import functools

    import grpc

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except CsiError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL), exc.message)
    return wrapper


def required(value, name: str):
    """INVALID_ARGUMENT naming the field when a REQUIRED field is empty."""
    if not value:
        raise invalid(f"{name} is required")
    return value
