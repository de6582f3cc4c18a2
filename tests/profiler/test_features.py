import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from profiler.features import FEATURE_NAMES, PromptFeatures, copyable_chars, prompt_features, repeated_ngram_share

PASSAGE = (
    "The Harrowgate canal was dug between 1791 and 1798 to carry coal from the upland pits to the mills "
    "along the river. Horses towed narrow boats along a path beside the water, and a flight of eleven locks "
    "lifted the boats over the ridge near Ashby. Trade fell after the railway opened in 1846, and the last "
    "commercial cargo passed through in 1931."
)
SUMMARY_PROMPT = f"Summarize the passage below in two sentences.\n\n{PASSAGE}"
QUESTION = "What is a good name for a cat?"
CODE_PROMPT = """Fix the bug in this function and show the full corrected code.

```python
def total_price(items, tax_rate):
    subtotal = sum(item.price for item in items)
    return subtotal * tax_rate
```"""


def features(text: str, turns: int = 1) -> PromptFeatures:
    return prompt_features(text, turns=turns, prompt_tokens=max(len(text) // 4, 1))


def test_pasted_passage_with_summarize_scores_higher_on_copy_features_than_a_question():
    summary, question = features(SUMMARY_PROMPT), features(QUESTION)
    assert summary.copyable_share > 0.8 and question.copyable_share == 0.0
    assert summary.log_copy_cues > question.log_copy_cues
    assert summary.log_prompt_tokens > question.log_prompt_tokens
    assert question.log_question_marks > summary.log_question_marks


def test_a_single_long_request_is_not_copyable_material():
    request = "Please write me a cheerful birthday message for my aunt, " * 5
    assert len(request) > 200
    assert copyable_chars(request) == 0


def test_code_snippet_has_code_markers():
    code, prose = features(CODE_PROMPT), features(SUMMARY_PROMPT)
    assert code.code_fence == 1.0 and prose.code_fence == 0.0
    assert code.code_symbol_share > prose.code_symbol_share
    assert code.code_keyword_share > 0 and prose.code_keyword_share == 0
    assert code.identifier_share > 0  # total_price, tax_rate
    assert code.copyable_share > 0.3  # the fenced lines


def test_quoted_lines_count_as_copyable():
    text = "Reply to this email politely.\n> Dear team, the invoice is late again.\n> Regards, Sam"
    assert copyable_chars(text) == len("> Dear team, the invoice is late again.") + len("> Regards, Sam")


def test_repetition_share():
    assert repeated_ngram_share("the cat sat on the mat " * 4) > 0.7
    assert repeated_ngram_share("every word here differs from all others") == 0.0
    assert repeated_ngram_share("two words") == 0.0


def test_cue_words_digits_and_non_ascii():
    open_ended = features("Why do people dream? Explain and imagine a story about it.")
    assert open_ended.log_open_cues > 0 and open_ended.log_copy_cues == 0
    assert features("Solve 12 + 30 = ?").digit_share > 0.2
    french = features("Traduisez en anglais : « Le café était déjà fermé à huit heures, hélas. »")
    assert french.non_ascii_share > 0 and features(QUESTION).non_ascii_share == 0


def test_vector_follows_feature_names():
    f = features(SUMMARY_PROMPT, turns=3)
    vector = f.vector()
    assert vector.shape == (len(FEATURE_NAMES),) and vector.dtype == np.float64
    assert vector[FEATURE_NAMES.index("turns")] == 3.0
    assert vector[FEATURE_NAMES.index("copyable_share")] == f.copyable_share


@pytest.mark.parametrize("text", ["", " ", "\n\n\n", "```", "?", "é"])
def test_degenerate_inputs_do_not_crash(text):
    vector = prompt_features(text, turns=0, prompt_tokens=0).vector()
    assert np.all(np.isfinite(vector))


def test_feature_modules_do_not_import_heavy_libraries():
    code = (
        "import sys, profiler.features, profiler.predictor; "
        "heavy = {'torch', 'transformers', 'ray'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
