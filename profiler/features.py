"""Prompt features the α and ρ predictors read before anything is decoded.

Speculative acceptance depends mostly on how much of the answer the prompt already contains:
prompt-lookup (n-gram) drafting only proposes text that occurs in the prompt, and draft models
also agree with the target more on copied or formulaic text (code, quotes, translations of a
given passage) than on free prose. So the features measure:

- size: tokens, words, lines, messages, and how much of the text is the last line (a closing
  request) rather than material above it;
- repetition: the share of word n-grams (n = 1..4) that recur, the vocabulary's variety, and how
  many distinct word pairs a lookup could match at all (character 8-gram repetition was tried and
  added nothing in cross-validation on the project's prompts, at a quarter of the cost);
- material an answer can copy: long passages, code (fenced or indented), quoted text, bulleted or
  numbered lists, table rows;
- the request: which kinds of instruction verb it uses (edit and show in full, translate,
  summarize, quote from passages, list, explain, write something new, solve);
- language and script: non-ASCII characters, letters outside the Latin script, the share of
  common English words, and the share of the text in paragraphs that are not English.

Every feature is one pass (or a fixed number of passes) over the text, linear in its length, and
needs no tokenizer: the router computes them on each request. Pure stdlib + numpy.
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
# Word n-grams used for the repetition shares: 1-grams are vocabulary reuse, 3- and 4-grams repeat
# rarely by chance in prose, so they mark formulaic or copied text.
REPEAT_NGRAMS = (1, 2, 3, 4)
# A paragraph of at least this many words with under this share of common English words is text
# in another language (a translation's source).
FOREIGN_MIN_WORDS = 8
FOREIGN_MAX_ENGLISH_SHARE = 0.12

_WORD = re.compile(r"\w+")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CAMEL = re.compile(r"[a-z][A-Z]")
_DIGIT = re.compile(r"\d")
_LETTER = re.compile(r"[^\W\d_]")
# Letters past the Latin script blocks (Basic Latin to Latin Extended-B end at U+024F).
_NON_LATIN_LETTER = re.compile(r"[^\W\d_\x00-\u024f]")
_CODE_SYMBOLS = frozenset("{}()[];=<>")
# Case-sensitive: SQL is written upper case in code, and `class`/`return`/`function` are rare enough
# in prose that a few false hits only add noise that the regressor weighs against the other signals.
_CODE_KEYWORDS = frozenset(
    "def class return import function const var elif lambda async await void struct fn self None True "
    "False null nullptr println printf SELECT FROM WHERE JOIN GROUP ORDER INSERT UPDATE".split()
)
# Function words of English prose; other languages (even in the Latin script) use few of them.
_ENGLISH_WORDS = frozenset(
    "the of and to in is it that for was on are with as be at by this have from or an they which you "
    "we he she his her their there been has had were will would can could should not but what all if "
    "when who how your my our its into than then them these those so do does did about more no".split()
)
# A quoted stretch of at least 20 characters on straight, curly or angle quotes.
_QUOTED = re.compile(r"\"[^\"]{20,}\"|“[^”]{20,}”|«[^»]{20,}»|„[^“”]{20,}[“”]")
_LIST_ITEM = re.compile(r"\s*(?:[-*•+]|\d{1,3}[.)]|\[\d{1,3}\]|[a-zA-Z][.)])\s+\S")
_INDENTED_CODE = re.compile(r"(?: {4}|\t)\S")
# The instruction kinds, each a group of lowercase cue words; the features say which groups the
# prompt uses. One pattern with a named group per kind, run once over the lowercased text: nine
# case-insensitive scans of a long prompt cost several times more.
_INSTRUCTION_KINDS: dict[str, str] = {
    # Edit the given text: the answer is the input with changes.
    "edit": r"rewrite|rephrase|reword|paraphrase|fix|correct|refactor|rename|convert|edit|proofread|polish|"
    r"improve|reformat|add (?:type hints|a docstring|docstrings|comments)",
    # Keep the input as it is: the answer repeats it in full.
    "keep": r"show the (?:full|complete|whole|entire|updated|corrected|rewritten)|keep (?:all|every|the same|"
    r"exactly|the formatting|the meaning)|unchanged|verbatim|word for word|exact(?:ly)?|as it is|only the",
    "translate": r"translat\w*|into (?:english|french|german|spanish|italian|portuguese|dutch|polish|japanese|"
    r"chinese)",
    "summarize": r"summar\w*|tl;?dr|condense|shorten|key points|main points|in (?:one|two|three) sentences",
    # Answer from supplied passages, citing them.
    "quote": r"quot\w*|cite|according to|based on|using only|passages?|retrieved|excerpts?|search results",
    "list": r"extract|list|which|find",
    "explain": r"explain\w*|describe|why|how (?:do|does|can|should|would)|what is|difference",
    # Write new text: little of the prompt to copy.
    "write": r"write|create|compose|draft|generate|imagine|story|poem|suggest\w*|ideas?|brainstorm|advice",
    "solve": r"solve|calculate|compute|how (?:many|much|long|far)|equation|step by step",
}
_INSTRUCTIONS = re.compile(r"\b(?:" + "|".join(f"(?P<{k}>{p})" for k, p in _INSTRUCTION_KINDS.items()) + r")\b")


@dataclass(frozen=True, slots=True)
class PromptFeatures:
    """Numeric description of one prompt; `vector()` gives the fields in `FEATURE_NAMES` order."""

    log_prompt_tokens: float
    turns: float
    log_lines: float
    log_words: float
    last_line_share: float  # share of characters on the last non-empty line (a closing request)
    log_distinct_bigrams: float  # distinct word pairs: how much a lookup can match at all
    repeated_1gram_share: float  # share of words that occur more than once in the prompt
    repeated_2gram_share: float
    repeated_3gram_share: float
    repeated_4gram_share: float
    distinct_word_share: float  # distinct words over words (type-token ratio)
    copyable_share: float  # share of characters in long paragraphs, quoted lines or code fences
    code_share: float  # share of characters on fenced or indented code lines
    quoted_share: float  # share of characters inside quotation marks or on `>` lines
    list_share: float  # share of characters on bulleted, numbered or [n]-labelled lines
    table_share: float  # share of characters on table rows (two or more `|`, or a tab)
    code_fence: float  # 1.0 when the prompt contains a ``` fence
    code_symbol_share: float  # share of characters in {}()[];=<>
    code_keyword_share: float  # share of identifiers that are programming keywords
    identifier_share: float  # share of identifiers written snake_case or camelCase
    digit_share: float
    log_question_marks: float
    asks_edit: float  # 1.0 when the prompt uses a cue of that instruction kind (see _INSTRUCTIONS)
    asks_keep: float
    asks_translate: float
    asks_summarize: float
    asks_quote: float
    asks_list: float
    asks_explain: float
    asks_write: float
    asks_solve: float
    non_ascii_share: float  # translation sources and targets outside English
    non_latin_share: float  # share of letters outside the Latin script (Cyrillic, Greek, CJK, ...)
    english_word_share: float  # share of words that are common English function words
    foreign_share: float  # share of characters in paragraphs that read as another language

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
    words = [w.lower() for w in _WORD.findall(text)]
    identifiers = _IDENTIFIER.findall(text)
    letters = len(_LETTER.findall(text))
    asked = {match.lastgroup for match in _INSTRUCTIONS.finditer(text.lower())}
    asks = {kind: 1.0 if kind in asked else 0.0 for kind in _INSTRUCTION_KINDS}
    repeated = {n: _repeated_share(words, n) for n in REPEAT_NGRAMS}
    return PromptFeatures(
        log_prompt_tokens=math.log1p(max(prompt_tokens, 0)),
        turns=float(max(turns, 0)),
        log_lines=math.log1p(len(lines)),
        log_words=math.log1p(len(words)),
        last_line_share=len(lines[-1].strip()) / chars if lines else 0.0,
        log_distinct_bigrams=math.log1p(len(set(zip(words, words[1:], strict=False)))),
        repeated_1gram_share=repeated[1],
        repeated_2gram_share=repeated[2],
        repeated_3gram_share=repeated[3],
        repeated_4gram_share=repeated[4],
        distinct_word_share=len(set(words)) / len(words) if words else 0.0,
        copyable_share=copyable_chars(text) / chars,
        code_share=code_chars(text) / chars,
        quoted_share=quoted_chars(text) / chars,
        list_share=sum(len(line) for line in lines if _LIST_ITEM.match(line)) / chars,
        table_share=sum(len(line) for line in lines if line.count("|") >= 2 or "\t" in line.strip()) / chars,
        code_fence=1.0 if "```" in text else 0.0,
        code_symbol_share=sum(text.count(c) for c in _CODE_SYMBOLS) / chars,
        code_keyword_share=_share(identifiers, lambda word: word in _CODE_KEYWORDS),
        identifier_share=_share(identifiers, _looks_like_identifier),
        digit_share=len(_DIGIT.findall(text)) / chars,
        log_question_marks=math.log1p(text.count("?")),
        asks_edit=asks["edit"],
        asks_keep=asks["keep"],
        asks_translate=asks["translate"],
        asks_summarize=asks["summarize"],
        asks_quote=asks["quote"],
        asks_list=asks["list"],
        asks_explain=asks["explain"],
        asks_write=asks["write"],
        asks_solve=asks["solve"],
        non_ascii_share=(len(text) - len(text.encode("ascii", "ignore"))) / chars,
        non_latin_share=len(_NON_LATIN_LETTER.findall(text)) / letters if letters else 0.0,
        english_word_share=_share(words, lambda word: word in _ENGLISH_WORDS),
        foreign_share=foreign_chars(text) / chars,
    )


def repeated_ngram_share(text: str, n: int = 3) -> float:
    """Share of the prompt's word n-grams that occur more than once in it (case-insensitive).

    Repetition inside the prompt (a variable used throughout a snippet, a name recurring in a
    passage) is what an n-gram lookup drafter matches on, and what the answer tends to repeat.
    """
    return _repeated_share([w.lower() for w in _WORD.findall(text)], n)


def _repeated_share(words: list[str], n: int) -> float:
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


def code_chars(text: str) -> int:
    """Characters on code lines: inside ``` fences, or indented by four spaces or a tab outside them."""
    total, in_fence = 0, False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
        elif in_fence or _INDENTED_CODE.match(line):
            total += len(line)
    return total


def quoted_chars(text: str) -> int:
    """Characters inside quotation marks (stretches of 20 or more) or on `>` quoted lines."""
    inline = sum(len(m.group()) for m in _QUOTED.finditer(text))
    return inline + sum(len(line) for line in text.splitlines() if line.lstrip().startswith(">"))


def foreign_chars(text: str) -> int:
    """Characters in paragraphs of FOREIGN_MIN_WORDS or more words that use almost no common English
    words: text in another language, which a translation request supplies."""
    _, paragraphs = _split_blocks(text)
    total = 0
    for paragraph in paragraphs:
        words = [w.lower() for w in _WORD.findall(paragraph)]
        if len(words) >= FOREIGN_MIN_WORDS and _share(words, lambda w: w in _ENGLISH_WORDS) < FOREIGN_MAX_ENGLISH_SHARE:
            total += len(paragraph)
    return total


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
    # `word[1:].islower()` first: most words are prose, and it rules out camelCase without a regex.
    return "_" in word.strip("_") or (not word[1:].islower() and _CAMEL.search(word) is not None)


def _share(items: list[str], predicate: Callable[[str], bool]) -> float:
    if not items:
        return 0.0
    return sum(1 for item in items if predicate(item)) / len(items)
