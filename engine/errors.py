"""The error the engine raises for a request it refuses. Must not know about HTTP.

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
