"""OpenAI's Responses API (`POST /v1/responses`), stateless."""

from __future__ import annotations

from flask import Blueprint

routes = Blueprint("responses", __name__)
