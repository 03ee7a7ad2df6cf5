"""Embeddings, reranking, scores and classification (a model with option.task text-embedding or text-classification)."""

from __future__ import annotations

from flask import Blueprint

routes = Blueprint("pooling", __name__)
