"""The errors the engine raises: a request it refuses, a step that failed. Must not know about
HTTP.

It carries the request field it is about (`param`, in the engine's names: prompt, max_tokens,
temperature, logit_bias, ...) and a machine-readable `code`; the server maps both to its 400
without parsing the message.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None,
                 code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class StepError(RuntimeError):
    """A step raised. The engine has aborted the requests the step touched (`request_ids`);
    `intact` says whether its state (block pool, queues, device) is still consistent, so that
    the others may go on. The original exception is the `__cause__`."""

    def __init__(self, request_ids: list[str], intact: bool) -> None:
        super().__init__(f"the engine step failed ({len(request_ids)} requests; "
                         f"{'state intact' if intact else 'state lost'})")
        self.request_ids, self.intact = request_ids, intact
