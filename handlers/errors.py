"""The error model of the HTTP API: every failure is JSON `{"code", "type", "error"}`."""

from __future__ import annotations

import json

from flask import Response

TYPES = {400: "BadRequest", 404: "NotFound", 405: "MethodNotAllowed", 413: "PayloadTooLarge",
         424: "ModelError", 500: "InternalServerError", 503: "ServiceUnavailable", 507: "OutOfMemory"}


class HttpError(Exception):
    def __init__(self, code: int, message: str, *, retry_after: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after if retry_after is not None else (1 if code == 503 else None)

    def body(self) -> dict:
        return {"code": self.code, "type": TYPES.get(self.code, "Error"), "error": self.message}

    def response(self) -> Response:
        resp = Response(json.dumps(self.body()), status=self.code, mimetype="application/json")
        if self.retry_after is not None:
            resp.headers["Retry-After"] = str(self.retry_after)
        return resp


def bad_request(message: str) -> HttpError:
    return HttpError(400, message)
