"""Incremental detokenization and stop strings. Must not touch the engine.

`IncrementalDetokenizer` turns token ids into text deltas that never split a UTF-8 character:
it decodes a small window of recent tokens (so tokenizers that drop or add leading spaces at a
window start agree with a full decode) and holds text back while it ends in U+FFFD, the
replacement character of an incomplete byte sequence.

`StopChecker` cuts the text at the first stop string, also one spanning several tokens, and
holds back any tail that could still become a stop string, so a stream never shows a partial
stop string.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 keep: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.keep = keep  # special tokens written out all the same (Mistral's [TOOL_CALLS])
        # The Rust tokenizer behind a fast tokenizer decodes the same text without the Python
        # wrapper's per-call overhead (unless the wrapper post-processes spaces).
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = (backend if backend is not None and hasattr(backend, "decode")
                         and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
                         else None)
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: decoded text before read_offset is known
        self.read_offset = 0  # tokens whose text has been emitted

    def _decode(self, ids: list[int]) -> str:
        if not self.keep.intersection(ids):
            return self._decode_run(ids)
        parts, run = [], []
        for token_id in ids:
            if token_id in self.keep:
                parts += [self._decode_run(run), self.tokenizer.convert_ids_to_tokens(token_id)]
                run = []
            else:
                run.append(token_id)
        return "".join(parts) + self._decode_run(run)

    def _decode_run(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; returns the newly complete text (possibly empty)."""
        self.ids += new_ids
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is left, even an incomplete character."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        delta = self._decode(self.ids[self.prefix_offset:])[len(prefix_text):]
        self.read_offset = len(self.ids)
        return delta


class StopChecker:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops or () if s]
        self.text = ""  # everything seen
        self.emitted = 0  # characters of `text` already released
        self.stopped = False

    def feed(self, delta: str, final: bool = False) -> str:
        """Add text; returns what can be released now. After a stop, nothing more."""
        if self.stopped:
            return ""
        self.text += delta
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        if final or not self.stops:
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def _first_stop(self) -> int | None:
        start = max(0, self.emitted - max(len(s) for s in self.stops) + 1) if self.stops else 0
        hits = [i for s in self.stops if (i := self.text.find(s, start)) != -1]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out
