"""What a server running dynamic batching (batch_size>1 or option.rolling_batch=disable) refuses, and
why, in one table: dynamic batching runs HF `generate` on whole batches, so it streams nothing, keeps
no alternatives per token, has no penalties or logit masks of ours, and serves none of the routes that
need those. Every route asks here (`refuse_on_dynamic`); the sentences are the API's error messages."""

from __future__ import annotations

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
