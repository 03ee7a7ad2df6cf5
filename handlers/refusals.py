"""What a server running dynamic batching (batch_size>1 or option.rolling_batch=disable) refuses, and
why, in one table: dynamic batching runs HF `generate` on whole batches, so it streams nothing, keeps
no alternatives per token, has no penalties or logit masks of ours, and serves none of the routes that
need those. Every route asks here (`refuse_on_dynamic`); the sentences are the API's error messages."""

from __future__ import annotations

from engines.config import TASK_CLASSIFICATION, TASK_EMBEDDING, TASK_GENERATION
from handlers.errors import bad_request

DYNAMIC = "dynamic batching (batch_size>1 or option.rolling_batch=disable)"

# feature → (the 400's message, the parameter it names or None)
ON_DYNAMIC = {
    "openai_routes": (f"the OpenAI routes need a rolling-batch engine; this server runs {DYNAMIC}: use /invocations",
                      None),
    "tgi_routes": ("the TGI routes need a rolling-batch engine; this server runs dynamic batching: use /invocations",
                   None),
    "chat": ("chat requests (\"messages\") need a rolling-batch engine: chat completions are not available with "
             f"{DYNAMIC}", None),
    "stream": (f"streaming is not supported with {DYNAMIC}; send \"stream\": false", None),
    "output_penalties": ("presence_penalty and frequency_penalty need a rolling-batch engine (dynamic batching runs "
                         "HF generate, which has neither)", None),
    "top_n_tokens": ("top_n_tokens needs a rolling-batch engine (dynamic batching runs HF generate, which keeps no "
                     "alternatives per token)", "top_n_tokens"),
    "logit_masks": ("logit_bias, min_tokens and bad_words need a rolling-batch engine (dynamic batching runs HF "
                    "generate as it is)", None),
    "prompt_logprobs": ("the prompt's log-probabilities (decoder_input_details, echo with logprobs) need a "
                        "rolling-batch engine", "decoder_input_details"),
}


def refuse_on_dynamic(is_dynamic: bool, feature: str, param: str | None = None) -> None:
    """A 400 naming why, when the server runs dynamic batching (`param`: the parameter to name, where
    the table leaves it to the request)."""
    if is_dynamic:
        message, named = ON_DYNAMIC[feature]
        raise bad_request(message, param or named)


def refuse_dynamic_sampling(is_dynamic: bool, sampling) -> None:
    """The sampling settings dynamic batching cannot honour (engines.sampling_params.SamplingParams)."""
    if not is_dynamic:
        return
    if sampling.has_output_penalties:
        refuse_on_dynamic(is_dynamic, "output_penalties")
    if sampling.top_n_tokens:
        refuse_on_dynamic(is_dynamic, "top_n_tokens")
    if sampling.has_logit_masks:
        refuse_on_dynamic(is_dynamic, "logit_masks", "logit_bias" if sampling.logit_bias else
                          "min_tokens" if sampling.min_tokens else "bad_words")
    if sampling.prompt_logprobs:
        refuse_on_dynamic(is_dynamic, "prompt_logprobs")


# a model's task (option.task) → the routes that serve it, as the 400 on any other route names them
TASK_ROUTES = {
    TASK_GENERATION: "/invocations, /v1/chat/completions, /v1/completions, /v1/responses, /generate",
    TASK_EMBEDDING: "/v1/embeddings, /embed, /v1/score, /invocations",
    TASK_CLASSIFICATION: "/rerank, /v1/rerank, /v1/score, /invocations",
}


def refuse_wrong_task(task: str, wanted: str | tuple[str, ...], what: str) -> None:
    """A 400 when the model's task is not (one of) `wanted`: `what` (the route's work, "text generation")
    is not what this model does, and the sentence names the routes that serve it."""
    if task == wanted or (isinstance(wanted, tuple) and task in wanted):
        return
    raise bad_request(f"{what} is not available: this model serves {task} (option.task); use {TASK_ROUTES[task]}")
