import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from profiler.features import (
    FEATURE_NAMES,
    PromptFeatures,
    code_chars,
    copyable_chars,
    foreign_chars,
    prompt_features,
    quoted_chars,
    repeated_ngram_share,
)

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
    assert summary.asks_summarize == 1.0 and question.asks_summarize == 0.0
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


def test_repetition_shares_at_each_n_count_the_recurring_grams():
    # 6 words, "the cat" twice: no trigram recurs.
    f = features("the cat sat the cat ran")
    assert f.repeated_1gram_share == pytest.approx(4 / 6)  # the ×2, cat ×2
    assert f.repeated_2gram_share == pytest.approx(2 / 5)  # (the, cat) ×2 of 5 bigrams
    assert f.repeated_3gram_share == 0.0 and f.repeated_4gram_share == 0.0
    assert f.distinct_word_share == pytest.approx(4 / 6)
    assert f.log_distinct_bigrams == pytest.approx(np.log1p(4))  # (the cat) (cat sat) (sat the) (cat ran)
    assert f.log_words == pytest.approx(np.log1p(6))


def test_code_quotes_lists_and_tables_are_measured_as_shares_of_the_text():
    code = "Explain:\n```\nx = 1\n```\n    y = 2\nok"
    assert code_chars(code) == len("x = 1") + len("    y = 2")
    quoted = 'She said "this sentence is quoted in full here" and left.'
    assert quoted_chars(quoted) == len('"this sentence is quoted in full here"')
    assert quoted_chars('a "short" word') == 0  # under 20 characters: emphasis, not a passage
    listed = "Keep these:\n- milk\n2. eggs\n[3] bread"
    assert features(listed).list_share == pytest.approx((6 + 7 + 9) / len(listed))
    table = "| a | b |\n| 1 | 2 |\nnot a row"
    assert features(table).table_share == pytest.approx(18 / len(table))


def test_last_line_share_separates_a_closing_request_from_the_material_above_it():
    assert features(QUESTION).last_line_share == 1.0
    assert features(f"{PASSAGE}\n\nSummarize that.").last_line_share == pytest.approx(15 / (len(PASSAGE) + 17))


def test_instruction_kinds():
    f = features("Rewrite this and show the full text, keeping it unchanged. Then translate it into German.")
    assert (f.asks_edit, f.asks_keep, f.asks_translate) == (1.0, 1.0, 1.0)
    assert (f.asks_summarize, f.asks_quote, f.asks_explain, f.asks_write, f.asks_solve) == (0.0,) * 5
    assert features("Quote the passages that answer which year it was.").asks_quote == 1.0
    assert features("Solve 2x + 3 = 7 step by step.").asks_solve == 1.0
    assert features("Write a poem about rain.").asks_write == 1.0
    assert features("Why is the sky blue?").asks_explain == 1.0


def test_cue_words_digits_and_non_ascii():
    open_ended = features("Why do people dream? Explain and imagine a story about it.")
    assert open_ended.asks_explain == 1.0 and open_ended.asks_write == 1.0 and open_ended.asks_edit == 0.0
    assert features("Solve 12 + 30 = ?").digit_share > 0.2
    french = features("Traduisez en anglais : « Le café était déjà fermé à huit heures, hélas. »")
    assert french.non_ascii_share > 0 and features(QUESTION).non_ascii_share == 0


def test_language_and_script():
    french = "Le mois dernier, notre association de quartier a organisé une grande journée de nettoyage."
    prompt = f"Translate this into English.\n\n{french}"
    assert foreign_chars(prompt) == len(french)  # the English request line is too short to judge
    assert foreign_chars(SUMMARY_PROMPT) == 0
    assert features(prompt).english_word_share < features(PASSAGE).english_word_share
    assert features("Привет, мир").non_latin_share == 1.0
    assert features("Café olé").non_latin_share == 0.0  # accented Latin letters are Latin
    assert features("Hello 世界").non_latin_share == pytest.approx(2 / 7)


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
