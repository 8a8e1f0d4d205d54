"""The stop conditions the scheduler checks token by token, with no text: a stop token (EOS
included) once ``min_tokens`` are out, ``max_tokens``, and the end of the context. Stop strings
need text: the engine matches them and calls ``Scheduler.finish_request``."""

from __future__ import annotations

from tokenmill.request import Request, RequestStatus

Stop = tuple[RequestStatus, int | None]  # the finished status and the stop reason


def append_until_stop(request: Request, token_ids: list[int],
                      max_model_len: int) -> tuple[list[int], Stop | None]:
    """Append tokens one at a time; a stop condition keeps its token and drops the rest.
    Returns the tokens appended and the stop, if any."""
    for i, token_id in enumerate(token_ids):
        request.output_token_ids.append(token_id)
        stop = check_stop(request, token_id, max_model_len)
        if stop is not None:
            return token_ids[:i + 1], stop
    return token_ids, None


def check_stop(request: Request, token_id: int, max_model_len: int) -> Stop | None:
    """Whether ``token_id``, just appended, ends the sequence."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)  # the decode hot path: no properties
    if num_output >= params.min_tokens and token_id in request.stop_token_ids:
        # The stop reason names a stop token the caller chose; EOS is reported as None.
        reason = token_id if token_id in params.stop_token_ids else None
        return RequestStatus.FINISHED_STOPPED, reason
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if num_output + len(request.prompt_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None
