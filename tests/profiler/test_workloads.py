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


def test_the_held_out_set_covers_the_same_categories_with_realistic_lengths(tokenizer):
    held_out = load_prompt_set("heldout")
    assert set(held_out.categories) == CATEGORIES
    assert all(len(c.prompts) >= 6 for c in held_out.categories.values())
    prompts = [p for c in held_out.categories.values() for p in c.prompts]
    assert len({p.id for p in prompts}) == len(prompts) and all(p.messages[-1].role == "user" for p in prompts)

    def tokens(prompt) -> int:
        text = tokenizer.apply_chat_template([m.model_dump() for m in prompt.messages], tokenize=False)
        return len(tokenizer(text).input_ids)

    for name in ("summarization", "rag"):  # pasted documents and retrieved passages
        assert all(200 <= tokens(p) < 1024 for p in held_out.categories[name].prompts), name
    assert sum(len(p.messages) > 2 for p in held_out.categories["chat"].prompts) >= 3  # multi-turn chats


def test_the_held_out_set_shares_no_text_with_the_sets_things_are_tuned_or_trained_on():
    from backends.training.prompts import training_prompts

    held_out = {
        m.content for c in load_prompt_set("heldout").categories.values() for p in c.prompts for m in p.messages
    }
    project = {m.content for c in load_prompt_set().categories.values() for p in c.prompts for m in p.messages}
    trained = {m["content"] for p in training_prompts() for m in p.messages()}
    assert not held_out & project and not held_out & trained
