from profiler.workloads import load_prompt_set

CATEGORIES = {"chat", "code", "summarization", "rag", "translation", "math", "qa"}


def test_prompt_set_has_every_category_with_several_prompts():
    prompt_set = load_prompt_set()
    assert set(prompt_set.categories) == CATEGORIES
    assert all(len(c.prompts) >= 3 for c in prompt_set.categories.values())


def test_prompt_ids_are_unique_and_conversations_end_with_the_user():
    prompts = [p for c in load_prompt_set().categories.values() for p in c.prompts]
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.messages[-1].role == "user" for p in prompts)


def test_every_prompt_leaves_room_in_the_context(tokenizer):
    for category in load_prompt_set().categories.values():
        for prompt in category.prompts:
            text = tokenizer.apply_chat_template([m.model_dump() for m in prompt.messages], tokenize=False)
            assert len(tokenizer(text).input_ids) < 1024, prompt.id
