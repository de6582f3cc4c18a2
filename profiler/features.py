"""Prompt features the α predictor reads before anything is decoded.

Speculative acceptance depends mostly on how much of the answer the prompt already contains:
prompt-lookup (n-gram) drafting only proposes text that occurs in the prompt, and draft models
also agree with the target more on copied or formulaic text (code, quotes, translations of a
given passage) than on free prose. So the features measure "material an answer can copy" (long
passages, code, repetition), the kind of request (copy-type versus open-ended cues) and size.

Every feature is one pass over the text (linear time) and needs no tokenizer: the router computes
them on each request. Pure stdlib + numpy.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields

import numpy as np

# A paragraph at least this long is material supplied alongside the request (a passage, a memo,
# a snippet), rather than the request itself; a one-line question is far shorter.
LONG_BLOCK_CHARS = 200
# Word n-grams used for the repetition share: 3 words repeat rarely by chance in prose.
REPEAT_NGRAM = 3

_WORD = re.compile(r"\w+")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CAMEL = re.compile(r"[a-z][A-Z]")
_CODE_SYMBOLS = frozenset("{}()[];=<>")
# Case-sensitive: SQL is written upper case in code, and `class`/`return`/`function` are rare enough
# in prose that a few false hits only add noise that the regressor weighs against the other signals.
_CODE_KEYWORDS = frozenset(
    "def class return import function const var elif lambda async await void struct fn self None True "
    "False null nullptr println printf SELECT FROM WHERE JOIN GROUP ORDER INSERT UPDATE".split()
)
# Requests whose answer reuses the prompt's own words.
_COPY_CUES = re.compile(
    r"\b(?:summari[sz]e|summary|translat\w*|rewrite|rephrase|fix|refactor|rename|quot\w*|extract|"
    r"according to|based on|passages?|context|verbatim|word for word|exactly|same wording|as written|"
    r"reuse|above|below)\b",
    re.IGNORECASE,
)
# Requests whose answer is mostly new text.
_OPEN_CUES = re.compile(
    r"\b(?:why|explain\w*|story|opinion|imagine|describe|suggest\w*|advice|ideas?|poem|brainstorm|"
    r"what do you think|step by step|solve)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class PromptFeatures:
    """Numeric description of one prompt; `vector()` gives the fields in `FEATURE_NAMES` order."""

    log_prompt_tokens: float
    turns: float
    log_lines: float
    repeated_ngram_share: float  # share of word 3-grams that occur more than once in the prompt
    copyable_share: float  # share of characters in long paragraphs, quoted lines or code fences
    code_fence: float  # 1.0 when the prompt contains a ``` fence
    code_symbol_share: float  # share of characters in {}()[];=<>
    code_keyword_share: float  # share of identifiers that are programming keywords
    identifier_share: float  # share of identifiers written snake_case or camelCase
    digit_share: float
    log_question_marks: float
    log_copy_cues: float
    log_open_cues: float
    non_ascii_share: float  # translation sources and targets outside English

    def vector(self) -> np.ndarray:
        return np.asarray(astuple(self), dtype=np.float64)


FEATURE_NAMES: list[str] = [f.name for f in fields(PromptFeatures)]


def prompt_features(text: str, turns: int, prompt_tokens: int) -> PromptFeatures:
    """Features of a prompt as the router sees it (message contents joined by newlines).

    `turns` is the number of chat messages and `prompt_tokens` the tokenized length; both come
    from the request, so no tokenizer is needed here. Negative counts are treated as zero.
    """
    chars = max(len(text), 1)  # share denominators: an empty prompt gives zero shares, not NaN
    lines = [line for line in text.splitlines() if line.strip()]
    identifiers = _IDENTIFIER.findall(text)
    return PromptFeatures(
        log_prompt_tokens=math.log1p(max(prompt_tokens, 0)),
        turns=float(max(turns, 0)),
        log_lines=math.log1p(len(lines)),
        repeated_ngram_share=repeated_ngram_share(text),
        copyable_share=copyable_chars(text) / chars,
        code_fence=1.0 if "```" in text else 0.0,
        code_symbol_share=sum(1 for c in text if c in _CODE_SYMBOLS) / chars,
        code_keyword_share=_share(identifiers, lambda word: word in _CODE_KEYWORDS),
        identifier_share=_share(identifiers, _looks_like_identifier),
        digit_share=sum(1 for c in text if c.isdigit()) / chars,
        log_question_marks=math.log1p(text.count("?")),
        log_copy_cues=math.log1p(sum(1 for _ in _COPY_CUES.finditer(text))),
        log_open_cues=math.log1p(sum(1 for _ in _OPEN_CUES.finditer(text))),
        non_ascii_share=sum(1 for c in text if ord(c) > 127) / chars,
    )


def repeated_ngram_share(text: str, n: int = REPEAT_NGRAM) -> float:
    """Share of the prompt's word n-grams that occur more than once in it.

    Repetition inside the prompt (a variable used throughout a snippet, a name recurring in a
    passage) is what an n-gram lookup drafter matches on, and what the answer tends to repeat.
    """
    words = [w.lower() for w in _WORD.findall(text)]
    grams = list(zip(*(words[i:] for i in range(n)), strict=False))
    if not grams:
        return 0.0
    counts = Counter(grams)
    return sum(c for c in counts.values() if c > 1) / len(grams)


def copyable_chars(text: str) -> int:
    """Characters of text an answer can copy: code fences, quoted (`>`) lines, and paragraphs of at
    least LONG_BLOCK_CHARS when the prompt has more than one paragraph (a prompt that is a single
    paragraph is the request itself, with nothing supplied alongside it)."""
    fenced, paragraphs = _split_blocks(text)
    long_paragraphs = [p for p in paragraphs if len(p) >= LONG_BLOCK_CHARS] if len(paragraphs) > 1 else []
    return fenced + sum(len(p) for p in long_paragraphs)


def _split_blocks(text: str) -> tuple[int, list[str]]:
    """(characters inside fences or quoted lines, the remaining prose paragraphs)."""
    fenced = 0
    in_fence = False
    paragraphs: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        elif in_fence or stripped.startswith(">"):
            fenced += len(line)
        elif stripped:
            current.append(line)
            continue
        if current:  # a blank line, fence or quote ends the prose paragraph
            paragraphs.append("\n".join(current))
            current = []
    if current:
        paragraphs.append("\n".join(current))
    return fenced, paragraphs


def _looks_like_identifier(word: str) -> bool:
    return "_" in word.strip("_") or _CAMEL.search(word) is not None


def _share(words: list[str], predicate: Callable[[str], bool]) -> float:
    if not words:
        return 0.0
    return sum(1 for w in words if predicate(w)) / len(words)
