"""Split documents into overlapping chunks of roughly equal token counts for embedding."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


@dataclass(frozen=True)
class Chunk:
    doc_id: str
    index: int
    text: str
    num_tokens: int


def split_words(text: str) -> list[str]:
    """A cheap stand-in for a model tokenizer: words and punctuation marks."""
    return WORD.findall(text)


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in SENTENCE_END.split(text) if s.strip()]


def count_tokens(text: str, tokenize: Callable[[str], list[str]] = split_words) -> int:
    return len(tokenize(text))


def chunk_text(doc_id: str, text: str, max_tokens: int = 256, overlap: int = 32,
               tokenize: Callable[[str], list[str]] = split_words) -> list[Chunk]:
    """Pack whole sentences into chunks of at most max_tokens; each chunk repeats the last
    sentences of the previous one, up to overlap tokens. A sentence longer than max_tokens is
    cut at word boundaries."""
    if overlap >= max_tokens:
        raise ValueError("overlap must be smaller than max_tokens")
    pieces: list[tuple[str, int]] = []
    for sentence in split_sentences(text):
        words = tokenize(sentence)
        if len(words) <= max_tokens:
            pieces.append((sentence, len(words)))
            continue
        for start in range(0, len(words), max_tokens - overlap):
            part = words[start:start + max_tokens - overlap]
            pieces.append((" ".join(part), len(part)))
    chunks: list[Chunk] = []
    current: list[tuple[str, int]] = []
    size = 0
    for sentence, n in pieces:
        if current and size + n > max_tokens:
            chunks.append(_make_chunk(doc_id, len(chunks), current))
            current, size = _tail(current, overlap)
        current.append((sentence, n))
        size += n
    if current:
        chunks.append(_make_chunk(doc_id, len(chunks), current))
    return chunks


def _tail(pieces: list[tuple[str, int]], overlap: int) -> tuple[list[tuple[str, int]], int]:
    kept: list[tuple[str, int]] = []
    size = 0
    for sentence, n in reversed(pieces):
        if size + n > overlap:
            break
        kept.insert(0, (sentence, n))
        size += n
    return kept, size


def _make_chunk(doc_id: str, index: int, pieces: list[tuple[str, int]]) -> Chunk:
    return Chunk(doc_id, index, " ".join(s for s, _ in pieces), sum(n for _, n in pieces))


def chunk_documents(docs: Iterable[tuple[str, str]], max_tokens: int = 256,
                    overlap: int = 32) -> Iterable[Chunk]:
    for doc_id, text in docs:
        yield from chunk_text(doc_id, text, max_tokens, overlap)


def stats(chunks: list[Chunk]) -> dict[str, float]:
    if not chunks:
        return {"chunks": 0, "mean_tokens": 0.0, "max_tokens": 0}
    sizes = [c.num_tokens for c in chunks]
    return {"chunks": len(chunks), "mean_tokens": sum(sizes) / len(sizes),
            "max_tokens": max(sizes)}
