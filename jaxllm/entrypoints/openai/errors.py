"""The errors a client gets, as OpenAI's error JSON: `{"error": {"message", "type", "param", "code"}}`."""
import re

from jaxllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An error the client gets as OpenAI's error JSON, with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 415: "invalid_request_error",
                             503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def engine_dead_error() -> APIError:
    return APIError(503, "the engine has died; restart the server", type="service_unavailable",
                    code="engine_dead")


def shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica or once it is back",
                    code="server_shutdown")


def bad_request(error: Exception, fields) -> APIError:
    """A ValueError or TypeError of the engine's checks as a 400: its message starts with the
    field it names (`max_tokens must be >= 1, got 0`), which becomes the error's param."""
    message = " ".join(str(error).splitlines())
    match = re.match(r"(\w+)", message)
    param = match.group(1) if match and match.group(1) in fields else None
    return APIError(400, message, param=param)
