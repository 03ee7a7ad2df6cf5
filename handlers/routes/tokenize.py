"""The tokenizer routes: vLLM's `/tokenize` and `/detokenize`, TGI's `/tokenize`."""

from __future__ import annotations

from flask import Blueprint

routes = Blueprint("tokenize", __name__)
