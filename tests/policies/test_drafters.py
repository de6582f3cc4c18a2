"""The drafter registry: one entry per kind, names that map back to kinds, options that exist."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from policies.drafters import (
    KINDS,
    REGISTRY,
    SERVED_KINDS,
    TRAINED_KINDS,
    DrafterConfig,
    UnknownKindError,
    drafter_name,
    kind_of,
    option_kinds,
    spec,
)
from policies.errors import UserError


def test_kinds_are_unique_and_each_has_one_entry() -> None:
    assert len(set(KINDS)) == len(KINDS) == len(REGISTRY)
    assert all(spec(kind).kind == kind for kind in KINDS)
    assert set(SERVED_KINDS) <= set(KINDS) and SERVED_KINDS
    assert all(spec(kind).network and spec(kind).task for kind in TRAINED_KINDS)
    assert not any(s.network or s.task for s in REGISTRY if not s.trained)


def test_an_unknown_kind_is_a_user_error_listing_the_known_ones() -> None:
    with pytest.raises(UnknownKindError, match="unknown drafter kind 'jacobi': pick one of ngram, model") as info:
        spec("jacobi")
    assert isinstance(info.value, UserError)
    with pytest.raises(ValidationError, match="kind"):
        DrafterConfig(kind="jacobi")


@pytest.mark.parametrize("kind", KINDS)
def test_every_built_name_maps_back_to_its_kind(kind: str) -> None:
    name = drafter_name(DrafterConfig(kind=kind, exit_layer=6), "SmolLM2-135M-Instruct@bfloat16")
    assert kind_of(name) == kind
    assert name.startswith(kind)


def test_names_carry_what_tells_two_drafters_of_a_kind_apart() -> None:
    assert drafter_name(DrafterConfig(kind="early-exit", exit_layer=6)) == "early-exit-6"
    assert drafter_name(DrafterConfig(kind="model"), "SmolLM2-135M-Instruct@bfloat16") == (
        "model:SmolLM2-135M-Instruct@bfloat16"
    )
    assert drafter_name(DrafterConfig(kind="ngram", ngram_max=6)) == "ngram"
    assert kind_of("early-exit-adapter") == "early-exit-adapter"  # not an early exit at layer 'adapter'
    assert kind_of("something-else") == "something-else"


def test_every_option_is_a_config_field_read_by_some_kind() -> None:
    fields = set(DrafterConfig.model_fields) - {"kind"}
    listed = {option for s in REGISTRY for option in s.options}
    assert listed == fields
    assert option_kinds("ngram_max") == ["ngram"]


def test_options_for_another_kind_keep_their_values() -> None:
    options = DrafterConfig(ngram_max=6, draft_dtype="float32")
    other = options.of("eagle")
    assert (other.kind, other.ngram_max, other.draft_dtype) == ("eagle", 6, "float32")
    with pytest.raises(UnknownKindError, match="unknown drafter kind"):
        options.of("jacobi")


def test_auto_draft_dtype_is_bfloat16_except_a_draft_model_under_a_reduced_precision_target() -> None:
    auto = DrafterConfig()
    assert auto.draft_dtype == "auto"
    assert auto.of("model").draft_dtype_under("float32") == "bfloat16"
    assert auto.of("model").draft_dtype_under("bfloat16") is None  # weight-only: the method the weights fit
    assert auto.of("eagle").draft_dtype_under("bfloat16") == "bfloat16"
    assert DrafterConfig(kind="model", draft_dtype="float32").draft_dtype_under("bfloat16") == "float32"


def test_ngram_range_is_checked() -> None:
    with pytest.raises(ValidationError, match=r"ngram_min \(5\) must not exceed ngram_max \(4\)"):
        DrafterConfig(ngram_min=5)
