"""The server's refusals and failures as ``openai_protocol.ApiError`` (their JSON bodies are
OpenAI's ``{"error": {...}}``; hybridrt.server.app answers them)."""

from __future__ import annotations

from hybridrt import openai_protocol as api


def internal_error() -> api.ApiError:
    """A 500 that names nothing internal (the log has the details)."""
    return api.ApiError(500, "internal server error (the server's log has the details)",
                        kind="server_error")


def too_many_tokens(num: int, cap: int, max_model_len: int, where: str) -> api.ApiError:
    return api.bad(f"the prompt has {num} tokens, over this server's limit of {cap} "
                   f"(max_model_len is {max_model_len}; --max-prompt-tokens; or send "
                   f"truncate_prompt_tokens)", where)


def too_large(limit: int) -> api.ApiError:
    return api.too_large(f"the request body is over this server's limit of {limit} bytes "
                         f"(--max-body-bytes)")


def as_api_error(e: Exception) -> api.ApiError:
    """A request's own error (bad input, can never fit: ValueError) is a 400; the rest 500
    (an ApiError as it is)."""
    if isinstance(e, api.ApiError):
        return e
    if isinstance(e, ValueError):
        return api.bad(str(e))
    return api.ApiError(500, str(e), kind="server_error")
