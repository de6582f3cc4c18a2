"""The training prompt set: varied, categorised, split by topic, disjoint from the benchmark set."""

from collections import Counter

from backends.training.prompts import CATEGORIES, held_out_topic, split, training_prompts
from profiler.workloads import load_prompt_set


def test_hundreds_of_prompts_in_every_category_with_unique_ids():
    prompts = training_prompts()
    counts = Counter(p.category for p in prompts)
    assert set(counts) == set(CATEGORIES)
    assert all(n >= 200 for n in counts.values()), counts
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({p.user for p in prompts}) > 0.95 * len(prompts)  # phrasings and numbers vary


def test_the_set_is_deterministic_for_a_seed_and_varies_with_it():
    assert [p.user for p in training_prompts(0)] == [p.user for p in training_prompts(0)]
    assert [p.user for p in training_prompts(0)] != [p.user for p in training_prompts(1)]


def test_held_out_split_is_by_topic_and_covers_every_category():
    train, held = split(training_prompts())
    train_topics = {(p.category, p.topic) for p in train}
    held_topics = {(p.category, p.topic) for p in held}
    assert not train_topics & held_topics
    assert {c for c, _ in held_topics} == set(CATEGORIES)
    assert 0.05 < len(held) / (len(train) + len(held)) < 0.3
    assert all(held_out_topic(p.category, p.topic) for p in held)


def test_no_training_prompt_is_a_benchmark_prompt():
    bench = {m.content for c in load_prompt_set().categories.values() for p in c.prompts for m in p.messages}
    assert not bench & {p.user for p in training_prompts()}
