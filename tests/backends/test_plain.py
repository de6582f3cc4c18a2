import pytest
import torch
from transformers import GenerationConfig

from backends.errors import RequestError
from backends.generation import GenerationRequest
from backends.plain import left_pad, position_ids
from backends.sampling import SamplingParams

pytestmark = pytest.mark.slow

VARIED_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Translate to French: Good morning, how are you?",
    "The chemical symbol for gold is",
]


def _reference_greedy(loaded, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers' own greedy search, stopping at EOS like the engine does."""
    input_ids = torch.tensor([prompt_ids])
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, pad_token_id=loaded.tokenizer.pad_token_id)
    mask = torch.ones_like(input_ids)
    output = loaded.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
    tokens = output[0, len(prompt_ids) :].tolist()
    eos = loaded.tokenizer.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("prompt", VARIED_PROMPTS)
def test_greedy_matches_transformers_generate_token_for_token(loaded, engine, prompt):
    request = GenerationRequest(prompt=prompt, max_tokens=24)
    ours = engine.generate([request])[0]
    assert ours.token_ids == _reference_greedy(loaded, engine.encode(request), 24)


def test_greedy_chat_prompt_matches_transformers_generate_through_eos(loaded, engine):
    request = GenerationRequest(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=40)
    ours = engine.generate([request])[0]
    assert ours.token_ids == _reference_greedy(loaded, engine.encode(request), 40)
    assert ours.finish_reason == "stop" and ours.token_ids[-1] == loaded.tokenizer.eos_token_id


def test_each_row_of_a_mixed_length_batch_decodes_as_if_alone(engine):
    requests = [GenerationRequest(prompt=p, max_tokens=6 + 4 * i) for i, p in enumerate(VARIED_PROMPTS)]
    batched = engine.generate(requests)
    for request, result in zip(requests, batched, strict=True):
        alone = engine.generate([request])[0]
        assert result.token_ids == alone.token_ids
        assert result.completion_tokens == request.max_tokens == len(result.token_ids)


def test_long_prompt_leaving_first_does_not_disturb_the_short_ones(engine):
    long_prompt = "In a detailed report about the history of the printing press, we find that " * 4
    requests = [
        GenerationRequest(prompt=long_prompt, max_tokens=2),
        GenerationRequest(prompt="Hello", max_tokens=16),
        GenerationRequest(prompt="The sun rises in the", max_tokens=12),
    ]
    batched = engine.generate(requests)
    assert [len(r.token_ids) for r in batched] == [2, 16, 12]
    for request, result in zip(requests, batched, strict=True):
        assert result.token_ids == engine.generate([request])[0].token_ids


def test_rows_that_all_finish_in_the_same_step_end_the_batch(engine):
    requests = [GenerationRequest(prompt=p, max_tokens=1) for p in VARIED_PROMPTS[:3]]
    batched = engine.generate(requests)
    assert [r.completion_tokens for r in batched] == [1, 1, 1]
    assert [r.token_ids for r in batched] == [engine.generate([q])[0].token_ids for q in requests]
    assert all(r.finish_reason == "length" and r.tpot_s == 0.0 for r in batched)


def test_stop_string_ends_generation_and_is_not_returned(engine):
    free = engine.generate([GenerationRequest(prompt="1, 2, 3, 4,", max_tokens=20)])[0]
    assert " 7" in free.text
    stopped = engine.generate([GenerationRequest(prompt="1, 2, 3, 4,", max_tokens=20, stop=[" 7"])])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(" 7")]
    assert stopped.completion_tokens < free.completion_tokens


def test_ignore_eos_runs_to_max_tokens(engine):
    request = GenerationRequest(messages=[{"role": "user", "content": "Say hi."}], max_tokens=40, ignore_eos=True)
    result = engine.generate([request])[0]
    assert result.completion_tokens == 40 and result.finish_reason == "length"


def test_seeded_sampling_reproduces_and_ignores_batch_neighbours(engine):
    def sampled(seed: int) -> GenerationRequest:
        return GenerationRequest(
            prompt="Once upon a time", max_tokens=16, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
        )

    alone = engine.generate([sampled(1)])[0]
    again = engine.generate([sampled(1)])[0]
    other = engine.generate([sampled(2)])[0]
    with_neighbours = engine.generate([GenerationRequest(prompt="Hi", max_tokens=3), sampled(1)])[1]
    assert alone.token_ids == again.token_ids == with_neighbours.token_ids
    assert alone.token_ids != other.token_ids
    assert alone.seed == 1


def test_results_report_counts_and_timings(engine):
    request = GenerationRequest(prompt="The weather today is", max_tokens=5)
    result = engine.generate([request])[0]
    assert result.prompt_tokens == len(engine.encode(request))
    assert result.completion_tokens == 5
    assert result.ttft_s > 0 and result.tpot_s > 0 and result.tokens_per_s > 0


def test_prompt_beyond_the_context_window_is_refused(engine):
    with pytest.raises(ValueError, match="exceeds the model's context of 8192 tokens: shorten the prompt"):
        engine.generate([GenerationRequest(prompt="word " * 8000, max_tokens=500)])


def test_prompt_ids_the_router_sent_are_fed_as_they_are_and_checked_against_the_vocabulary(engine):
    text = GenerationRequest(prompt="The weather today is", max_tokens=5)
    ids = engine.encode(text)
    given = GenerationRequest(prompt="The weather today is", prompt_ids=ids, max_tokens=5, resume_ids=[11])
    assert engine.encode(given) == [*ids, 11]
    assert (
        engine.generate([given.model_copy(update={"resume_ids": []})])[0].token_ids
        == engine.generate([text])[0].token_ids
    )
    with pytest.raises(RequestError, match="prompt_ids must be token ids of this model's vocabulary"):
        engine.encode(GenerationRequest(prompt="x", prompt_ids=[1, engine.vocab], max_tokens=5))


def test_empty_batch_returns_nothing(engine):
    assert engine.generate([]) == []


def test_left_padding_puts_every_last_token_in_the_last_column():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert position_ids(mask).tolist() == [[0, 1, 2], [0, 0, 0]]
