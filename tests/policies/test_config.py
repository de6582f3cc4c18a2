import pickle
from pathlib import Path

import pytest
import yaml

from policies.config import (
    PolicyConfig,
    PolicyError,
    SpeculationConfig,
    default_policy,
    load_policy,
    parse_policy,
    policy_from_yaml,
)

DEPLOY_POLICY = Path(__file__).resolve().parents[2] / "deploy" / "policy.yaml"


def problems_of(text: str) -> str:
    """The PolicyError message for a YAML policy that must be refused."""
    with pytest.raises(PolicyError) as info:
        policy_from_yaml(text)
    return str(info.value)


def test_defaults():
    policy = default_policy()
    assert policy == PolicyConfig()
    assert policy.version == 1
    assert policy.speculation.enabled and policy.speculation.drafters == ["ngram", "model"]
    assert (policy.speculation.k_min, policy.speculation.k_max) == (1, 8)
    assert policy.speculation.min_speedup == 1.1 and policy.speculation.max_concurrency is None
    assert policy.batching.enabled and policy.batching.max_batch == 64
    assert policy.quantization.model_dump() == {
        "enabled": True,
        "min_agreement": 0.95,
        "when_faster": True,
        "min_concurrency": 16,
        "memory_pressure": 0.85,
        "on_slo_miss": True,
        "min_speedup": 1.05,
    }
    assert (policy.slo.ttft_ms, policy.slo.tpot_ms) == (2000.0, 250.0)
    assert policy.bottleneck.compute_bound_elasticity == 0.5
    assert policy.concurrency_override is None


def test_policy_is_frozen():
    with pytest.raises(ValueError, match="frozen"):
        PolicyConfig().batching.max_batch = 8  # type: ignore[misc]


def test_every_field_is_described_for_the_yaml_reader():
    sections = [
        PolicyConfig,
        *(f.annotation for f in PolicyConfig.model_fields.values() if hasattr(f.annotation, "model_fields")),
    ]
    for section in sections:
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no description"


def test_deploy_policy_is_exactly_the_defaults():
    assert load_policy(DEPLOY_POLICY) == PolicyConfig()


def test_deploy_policy_spells_out_every_key():
    data = yaml.safe_load(DEPLOY_POLICY.read_text(encoding="utf-8"))
    assert data == PolicyConfig().model_dump(mode="json")


def test_to_yaml_round_trips():
    policy = PolicyConfig(
        speculation=SpeculationConfig(drafters=["early-exit"], k_min=2, k_max=4, max_concurrency=32),
        slo={"ttft_ms": None, "tpot_ms": 80.5},
        concurrency_override=128,
    )
    assert policy_from_yaml(policy.to_yaml()) == policy
    assert policy_from_yaml(PolicyConfig().to_yaml()) == PolicyConfig()


def test_partial_policy_keeps_other_defaults():
    policy = policy_from_yaml("speculation:\n  k_max: 4\nslo:\n  tpot_ms: null\n")
    assert policy.speculation.k_max == 4 and policy.speculation.drafters == ["ngram", "model"]
    assert policy.slo.tpot_ms is None and policy.slo.ttft_ms == 2000.0
    assert policy.batching == PolicyConfig().batching


def test_section_left_empty_means_its_defaults():
    # Every child of `slo:` commented out makes the section YAML null.
    assert policy_from_yaml("slo:\n  # tpot_ms: 100\n") == PolicyConfig()


def test_unknown_top_level_key_lists_the_sections():
    message = problems_of("speculaton:\n  k_max: 4\n")
    assert (
        "speculaton: unknown key (allowed: version, speculation, batching, quantization, slo, bottleneck, calibration, "
        "concurrency_override)" in message
    )
    assert "did you mean speculation?" in message


def test_unknown_nested_key_names_the_dotted_path_and_its_section_keys():
    message = problems_of("slo:\n  tpot: 100\n")
    assert "slo.tpot: unknown key (allowed: ttft_ms, tpot_ms)" in message


@pytest.mark.parametrize(
    "text,expected",
    [
        ("speculation: {k_max: 40}", "speculation.k_max: Input should be less than or equal to 32 (got 40)"),
        ("speculation: {k_min: 5, k_max: 3}", "speculation.k_max: must be at least k_min (5), got 3"),
        ("speculation: {min_speedup: -1}", "speculation.min_speedup: Input should be greater than 0 (got -1)"),
        ("quantization: {min_agreement: 1.5}", "quantization.min_agreement: Input should be less than or equal to 1"),
        ("quantization: {memory_pressure: 0}", "quantization.memory_pressure: Input should be greater than 0"),
        ("bottleneck: {compute_bound_elasticity: 1.0}", "bottleneck.compute_bound_elasticity: Input should be less"),
        ("bottleneck: {compute_bound_elasticity: 0}", "bottleneck.compute_bound_elasticity: Input should be greater"),
        (
            "speculation: {drafters: []}",
            "speculation.drafters: needs at least one drafter while speculation is enabled",
        ),
        ("speculation: {drafters: [ngram, model, ngram]}", "speculation.drafters: listed more than once: ngram"),
        (
            "speculation: {drafters: [ngram, jacobi]}",
            "speculation.drafters[1]: Input should be 'ngram', 'model', 'early-exit', 'lookahead', 'eagle', 'medusa' "
            "or 'early-exit-adapter' (got 'jacobi')",
        ),
        ("batching: {max_batch: 5000}", "batching.max_batch: Input should be less than or equal to 4096"),
        ("concurrency_override: 0", "concurrency_override: Input should be greater than or equal to 1 (got 0)"),
        ("version: 2", "version: Input should be 1 (got 2)"),
    ],
)
def test_bad_values_name_the_field(text, expected):
    assert expected in problems_of(text)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("batching: {max_batch: eight}", "batching.max_batch: Input should be a valid integer"),
        ("speculation: {k_max: 4.5}", "speculation.k_max: Input should be a valid integer"),
        ("speculation: {enabled: maybe}", "speculation.enabled: Input should be a valid boolean"),
        ("slo: {tpot_ms: fast}", "slo.tpot_ms: Input should be a valid number"),
        ("speculation: {drafters: ngram}", "speculation.drafters: Input should be a valid list"),
        ("slo: 250", "slo: should be a mapping with keys ttft_ms, tpot_ms (got 250)"),
        ("slo: {tpot_ms: .nan}", "slo.tpot_ms: Input should be a finite number"),
    ],
)
def test_wrong_types_name_the_field(text, expected):
    assert expected in problems_of(text)


def test_empty_drafters_are_fine_when_speculation_is_off():
    policy = policy_from_yaml("speculation: {enabled: false, drafters: []}")
    assert not policy.speculation.enabled and policy.speculation.drafters == []


def test_speculation_and_batching_cannot_both_be_off():
    message = problems_of("speculation: {enabled: false}\nbatching: {enabled: false}\n")
    assert "speculation.enabled, batching.enabled: at least one must be true" in message
    assert "plain decoding is the fallback" in message


def test_all_problems_are_reported_together_one_per_line():
    message = problems_of(
        "speculation:\n  k_max: 40\n  drafters: [jacobi]\nquantization:\n  min_agreement: 1.5\nslo:\n  tpot: 1\n"
    )
    lines = message.splitlines()
    assert lines[0] == "policy: invalid policy"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "speculation.drafters[0]",
        "speculation.k_max",
        "quantization.min_agreement",
        "slo.tpot",
    ]


def test_error_keeps_its_problems_and_survives_pickling():
    with pytest.raises(PolicyError) as info:
        policy_from_yaml("speculation: {k_max: 40}\nbatching: {max_batch: 0}", source="live.yaml")
    error = info.value
    assert error.source == "live.yaml" and len(error.problems) == 2
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) and copy.problems == error.problems


def test_yaml_syntax_error_names_the_line_and_file(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("speculation:\n  k_max: 4\n  k_min: [1\nslo: {}\n", encoding="utf-8")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    message = str(info.value)
    assert message.startswith(f"{path}: invalid policy")
    assert "YAML syntax error at line 4" in message
    assert "Traceback" not in message


def test_duplicate_yaml_keys_are_refused_not_silently_overwritten():
    message = problems_of("speculation:\n  k_max: 4\n  k_max: 6\n")
    assert "YAML syntax error at line 3, column 3: duplicate key 'k_max'" in message


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(PolicyError, match="file not found") as info:
        load_policy(path)
    assert str(info.value).startswith(str(path))


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(PolicyError, match="is a directory"):
        load_policy(tmp_path)


@pytest.mark.parametrize("text,kind", [("- speculation\n- batching\n", "list"), ("just a string\n", "str")])
def test_non_mapping_top_level(text, kind):
    message = problems_of(text)
    assert "the top level must be a mapping with keys version, speculation" in message
    assert f"got {kind}" in message


def test_parse_policy_rejects_non_mapping_and_accepts_none():
    with pytest.raises(PolicyError, match="policy: invalid policy\n  the top level must be a mapping"):
        parse_policy(42)
    assert parse_policy(None) == PolicyConfig()
    assert parse_policy({}) == PolicyConfig()


@pytest.mark.parametrize("text", ["", "\n", "# only comments\n"])
def test_empty_file_gives_defaults(tmp_path, text):
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    assert load_policy(path) == PolicyConfig()
