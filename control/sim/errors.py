"""The simulator's errors as vLLM answers them (OpenAI-shaped JSON)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from wakegate.control.sim.sleep import SleepRefused
from wakegate.control.sim.text import dumps

JSON_CT = "application/json"


class BadRequest(Exception):
    def __init__(
        self, message: str, status: int = 400, kind: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        #: the request field at fault, where vLLM names one
        self.param = param


def error_response(
    status: int, message: str, kind: str, headers: dict[str, str] | None = None, param: str | None = None
) -> web.Response:
    """An OpenAI-shaped error, as vLLM returns it."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.Response(status=status, body=dumps(body).encode(), content_type=JSON_CT, headers=headers)


Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def refusals_answered(handler: Handler) -> Handler:
    """`handler` with its sleep-mode refusals answered as vLLM answers errors."""

    async def answered(request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await handler(request)
        except SleepRefused as exc:
            return error_response(exc.status, str(exc), "BadRequestError")

    return answered
