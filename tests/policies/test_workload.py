from pathlib import Path

import numpy as np
import pytest
import yaml

from policies.workload import ASSUMED_CORE_HOUR_USD, Lengths, WorkloadError, load_workload, parse_workload

CATEGORIES = ["chat", "code", "rag"]
REPO = Path(__file__).resolve().parents[2]


def base(**changes: object) -> dict:
    data = {"mix": {"chat": 0.5, "code": 0.5}, "load": {"arrival_rate": 2.0}}
    data.update(changes)
    return data


def problems(data: object) -> list[str]:
    with pytest.raises(WorkloadError) as caught:
        parse_workload(data, CATEGORIES, source="w.yaml")
    assert str(caught.value).startswith("w.yaml: invalid workload")
    return list(caught.value.problems)


def test_the_example_workload_is_valid_for_the_projects_categories():
    categories = ["chat", "code", "math", "qa", "rag", "summarization", "translation"]
    workload = load_workload(REPO / "deploy" / "workload.yaml", categories)
    assert sum(workload.mix.values()) == pytest.approx(1.0)
    assert workload.load.arrival_rate == 0.5
    assert workload.slo.e2e_p99_ms == 15000
    assert workload.pricing.replica_hour_usd == {}  # every price is the labelled $/core-hour assumption


def test_an_unknown_category_is_named_with_a_suggestion():
    found = problems(base(mix={"chatt": 0.5, "code": 0.5}))
    assert len(found) == 1
    assert found[0].startswith("mix.chatt: unknown category (the profile measured: chat, code, rag)")
    assert "did you mean chat?" in found[0]


def test_shares_must_sum_to_one():
    assert problems(base(mix={"chat": 0.5, "code": 0.3})) == ["mix: shares must sum to 1 (they sum to 0.8)"]


def test_negative_rates_and_shares_are_refused_with_their_path():
    found = problems(base(mix={"chat": -0.5, "code": 1.5}, load={"arrival_rate": -1}))
    assert any(p.startswith("mix.chat: Input should be greater than or equal to 0") for p in found)
    assert any(p.startswith("mix.code: Input should be less than or equal to 1") for p in found)
    assert any(p.startswith("load.arrival_rate: Input should be greater than 0") for p in found)


def test_load_needs_exactly_one_of_rate_and_concurrency():
    assert problems(base(load={})) == ["load: give exactly one of arrival_rate and concurrency"]
    both = problems(base(load={"arrival_rate": 1, "concurrency": [1, 4]}))
    assert both == ["load: give exactly one of arrival_rate and concurrency"]
    assert problems(base(load={"concurrency": [8, 2]})) == ["load.concurrency: must be [lowest, highest] (got [8, 2])"]


def test_mix_and_prompts_are_alternatives():
    assert problems({"load": {"arrival_rate": 1}}) == [
        "mix, prompts: give exactly one of mix (category shares) and prompts (a JSONL file)"
    ]


def test_unknown_keys_are_typos_with_the_allowed_ones_listed():
    found = problems(base(slo={"ttft": 100}))
    assert found[0].startswith("slo.ttft: unknown key (allowed: ttft_ms, tpot_ms, e2e_p99_ms, attainment)")
    assert "did you mean ttft_ms?" in found[0]


def test_an_unknown_backend_price_is_refused():
    found = problems(base(pricing={"replica_hour_usd": {"gpu": 1.0}}))
    assert found == ["pricing.replica_hour_usd: unknown backend gpu (known: auto, speculative, plain, quantized)"]


def test_replica_prices_are_per_backend_or_for_the_routed_service():
    workload = parse_workload(base(pricing={"replica_hour_usd": {"plain": 0.5, "auto": 0.9}}), CATEGORIES)
    assert workload.pricing.replica_hour_usd == {"plain": 0.5, "auto": 0.9}
    assert workload.pricing.core_hour_usd == ASSUMED_CORE_HOUR_USD


def test_lengths_must_be_ordered():
    found = problems(base(output_tokens={"mean": 10, "min": 20, "max": 5}))
    assert found == ["output_tokens: max (5) must be at least min (20)"]


def test_lengths_sample_within_bounds_with_the_asked_mean():
    rng = np.random.default_rng(0)
    lognormal = Lengths(mean=100, min=1, max=100_000, sigma=0.5).sample(rng, 20_000)
    assert lognormal.min() >= 1 and lognormal.dtype.kind == "i"
    assert lognormal.mean() == pytest.approx(100, rel=0.03)
    clipped = Lengths(mean=100, min=50, max=150, sigma=1.0).sample(rng, 1000)
    assert clipped.min() >= 50 and clipped.max() <= 150
    assert set(Lengths(distribution="fixed", mean=7, max=10).sample(rng, 5)) == {7}


def test_files_yaml_errors_and_relative_prompts(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(WorkloadError, match="file not found"):
        load_workload(missing, CATEGORIES)
    broken = tmp_path / "broken.yaml"
    broken.write_text("mix: {chat: 1\n")
    with pytest.raises(WorkloadError, match="YAML syntax error at line"):
        load_workload(broken, CATEGORIES)
    duplicate = tmp_path / "dup.yaml"
    duplicate.write_text("mix: {chat: 1}\nmix: {code: 1}\nload: {arrival_rate: 1}\n")
    with pytest.raises(WorkloadError, match="duplicate key 'mix'"):
        load_workload(duplicate, CATEGORIES)
    jsonl = tmp_path / "w.yaml"
    jsonl.write_text(yaml.safe_dump({"prompts": "mine.jsonl", "load": {"concurrency": [1, 8]}}))
    assert load_workload(jsonl, CATEGORIES).prompts == str(tmp_path / "mine.jsonl")


def test_the_top_level_must_be_a_mapping():
    assert problems(["mix"])[0].startswith("the top level must be a mapping with keys version, name, mix")
