"""The error model of the HTTP API: every failure is JSON `{"code", "type", "error"}`; on the OpenAI
routes (`/v1/...`) it is OpenAI's `{"error": {"message", "type", "param", "code"}}` instead; on the
TGI routes the body also carries TGI's `"error_type"`, which TGI's client turns into its exceptions."""

from __future__ import annotations

import json

from flask import Response

TYPES = {400: "BadRequest", 404: "NotFound", 405: "MethodNotAllowed", 413: "PayloadTooLarge",
         424: "ModelError", 500: "InternalServerError", 503: "ServiceUnavailable", 507: "OutOfMemory"}

# OpenAI's error types by status (its API reference; vLLM answers the same statuses)
OPENAI_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 424: "model_error", 503: "service_unavailable_error",
                507: "server_error"}


# TGI's error_type by status (text-generation's parse_error: validation, overloaded, generation)
TGI_TYPES = {400: "validation", 413: "validation", 503: "overloaded", 507: "overloaded", 424: "generation",
             500: "generation"}


class HttpError(Exception):
    def __init__(self, code: int, message: str, *, retry_after: int | None = None, param: str | None = None,
                 openai_code: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param  # the request field at fault (OpenAI's "param")
        self.openai_code = openai_code  # OpenAI's machine-readable "code", e.g. model_not_found
        self.retry_after = retry_after if retry_after is not None else (1 if code == 503 else None)

    def body(self) -> dict:
        return {"code": self.code, "type": TYPES.get(self.code, "Error"), "error": self.message}

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": OPENAI_TYPES.get(self.code, "server_error"),
                          "param": self.param, "code": self.openai_code}}

    def response(self, openai: bool = False, tgi: bool = False) -> Response:
        body = self.openai_body() if openai else self.body()
        if tgi and self.code in TGI_TYPES:
            body["error_type"] = TGI_TYPES[self.code]
        resp = Response(json.dumps(body), status=self.code, mimetype="application/json")
        if self.retry_after is not None:
            resp.headers["Retry-After"] = str(self.retry_after)
        return resp


def bad_request(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, param=param)
