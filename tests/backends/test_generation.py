import time

import pytest
from pydantic import ValidationError

from backends.generation import GenerationRequest, SequenceState


def _state(tokenizer, **request) -> SequenceState:
    request = GenerationRequest(prompt="x", **request)
    return SequenceState(request, [1, 2], frozenset({2}), seed=0, started_at=time.perf_counter())


def _feed(state: SequenceState, tokenizer, text: str) -> int:
    """Append the tokens of `text` until the state finishes; return how many were appended."""
    for count, token in enumerate(tokenizer(text, add_special_tokens=False).input_ids, start=1):
        if state.append(token, tokenizer):
            return count
    return -1


@pytest.mark.parametrize(
    ("fields", "hint"),
    [
        ({"prompt": "hi", "max_tokens": -5}, "greater than or equal to 1"),
        ({"prompt": "hi", "max_tokens": 0}, "greater than or equal to 1"),
        ({}, "exactly one of 'prompt' or 'messages'"),
        ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "exactly one of"),
        ({"prompt": ""}, "at least 1 character"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "'system', 'user' or 'assistant'"),
        ({"prompt": "hi", "stop": [""]}, "stop strings must be non-empty"),
        ({"prompt": "hi", "temperature": 0.5}, "Extra inputs are not permitted"),
    ],
)
def test_bad_requests_are_rejected_with_the_reason(fields, hint):
    with pytest.raises(ValidationError, match=hint):
        GenerationRequest(**fields)


def test_a_single_stop_string_is_accepted():
    assert GenerationRequest(prompt="hi", stop="\n").stop == ["\n"]


def test_stop_string_ends_the_sequence_and_is_cut_from_the_text(tokenizer):
    state = _state(tokenizer, stop=["STOP"], max_tokens=50)
    assert _feed(state, tokenizer, "alpha beta STOP gamma delta") > 0
    result = state.result(tokenizer)
    assert result.finish_reason == "stop"
    assert result.text == "alpha beta "


def test_earliest_of_several_stop_strings_wins(tokenizer):
    state = _state(tokenizer, stop=["delta", "beta"], max_tokens=50)
    _feed(state, tokenizer, "alpha beta gamma delta")
    assert state.result(tokenizer).text == "alpha "


@pytest.mark.parametrize(("text", "stop"), [("smile 😀 and more text", "😀"), ("价格是多少钱呢好的", "多少")])
def test_stop_strings_made_of_multi_byte_characters_are_found(tokenizer, text, stop):
    state = _state(tokenizer, stop=[stop], max_tokens=50)
    assert _feed(state, tokenizer, text) > 0
    result = state.result(tokenizer)
    assert result.finish_reason == "stop"
    assert result.text == text[: text.index(stop)]


def test_max_tokens_ends_with_length(tokenizer):
    state = _state(tokenizer, max_tokens=3)
    assert _feed(state, tokenizer, "one two three four five six") == 3
    assert state.result(tokenizer).finish_reason == "length"
    assert state.result(tokenizer).completion_tokens == 3


def test_eos_ends_with_stop_unless_ignored(tokenizer):
    state = _state(tokenizer, max_tokens=10)
    assert state.append(2, tokenizer) and state.finish_reason == "stop"
    ignoring = _state(tokenizer, max_tokens=10, ignore_eos=True)
    assert not ignoring.append(2, tokenizer)


def test_timings_come_from_token_arrival(tokenizer):
    state = _state(tokenizer, max_tokens=3)
    _feed(state, tokenizer, "one two three")
    result = state.result(tokenizer)
    assert result.ttft_s == pytest.approx(state.first_token_at - state.started_at)
    assert result.tpot_s == pytest.approx((state.finished_at - state.first_token_at) / 2)
