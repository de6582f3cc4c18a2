"""The routing policy config: the thresholds and switches an operator sets, read from YAML.

The policy never holds measurements: acceptance rates, step costs and memory use come from the
profile (`specroute profile`). This file only says how much a choice must pay before it is taken.

Every mistake is reported at once, one line per problem, as `<dotted.path>: <what is wrong>`, so
that a service reloading the policy can reject it, keep the last good one and log a message the
operator can act on without reading a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from .drafters import KINDS, SERVED_KINDS, DrafterKind
from .errors import UserError

# Errors raised by our own validators carry this type: their message is already complete, and a
# rule spanning several fields names them in ctx["path"] because its pydantic loc is the parent.
RULE_ERROR = "policy_rule"


class PolicyError(UserError):
    """A policy that cannot be used; the message lists every problem, one per line."""

    def __init__(self, source: str, problems: Iterable[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__(f"{source}: invalid policy\n" + "\n".join(f"  {p}" for p in self.problems))

    def __reduce__(self) -> tuple[type[PolicyError], tuple[str, tuple[str, ...]]]:
        # Ray ships exceptions between processes by pickling; ValueError's default would call
        # __init__ with the formatted message only.
        return type(self), (self.source, self.problems)


class _Section(BaseModel):
    # Unknown keys are almost always typos, and a silently ignored threshold is worse than a refusal.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class SpeculationConfig(_Section):
    enabled: bool = Field(True, description="Allow the speculative-decoding backend at all.")
    drafters: list[DrafterKind] = Field(
        default_factory=lambda: list(SERVED_KINDS),
        description=f"Drafters the policy may choose between ({', '.join(KINDS)}); each must be profiled.",
    )
    k_min: int = Field(1, ge=1, description="Fewest draft tokens per verification step the policy may pick.")
    k_max: int = Field(8, ge=1, le=32, description="Most draft tokens per verification step the policy may pick.")
    min_speedup: float = Field(
        1.1,
        gt=0,
        description="Predicted speedup over plain decoding at the same load required to speculate (1.0 = break-even).",
    )
    max_concurrency: int | None = Field(
        None,
        ge=1,
        description="Never speculate with this many or more requests in flight; null lets the cost model decide.",
    )

    @field_validator("drafters")
    @classmethod
    def _drafters(cls, drafters: list[str], info: ValidationInfo) -> list[str]:
        duplicates = sorted({d for d in drafters if drafters.count(d) > 1})
        if duplicates:
            raise PydanticCustomError(RULE_ERROR, f"listed more than once: {', '.join(duplicates)}")
        # `enabled` is declared first, so it is already validated here (absent only if it was invalid).
        if not drafters and info.data.get("enabled", False):
            raise PydanticCustomError(
                RULE_ERROR,
                "needs at least one drafter while speculation is enabled (or set speculation.enabled: false)",
            )
        return drafters

    @field_validator("k_max")
    @classmethod
    def _k_range(cls, k_max: int, info: ValidationInfo) -> int:
        # Checked on k_max rather than the model so the error names the field to change.
        k_min = info.data.get("k_min")
        if k_min is not None and k_max < k_min:
            raise PydanticCustomError(RULE_ERROR, f"must be at least k_min ({k_min}), got {k_max}")
        return k_max


class BatchingConfig(_Section):
    enabled: bool = Field(True, description="Allow the large-batch plain-decoding backend.")
    max_batch: int = Field(64, ge=1, le=4096, description="Most sequences decoded together in one step.")


class QuantizationConfig(_Section):
    enabled: bool = Field(True, description="Allow the quantized backend.")
    min_agreement: float = Field(
        0.95,
        ge=0,
        le=1,
        description="Quality floor: measured teacher-forced share of tokens whose argmax equals the full-precision "
        "target's.",
    )
    when_faster: bool = Field(
        True,
        description="Justified whenever the measured quality meets the floor and the quantized backend is predicted "
        "faster (min_speedup); false: only load, memory pressure or an SLO miss justify it.",
    )
    min_concurrency: int | None = Field(
        16,
        ge=1,
        description="Requests in flight at which quantization is justified; null: load alone never justifies it.",
    )
    memory_pressure: float | None = Field(
        0.85,
        gt=0,
        le=1,
        description="Accelerator memory utilisation (0-1] at or above which quantization is justified; null: never.",
    )
    on_slo_miss: bool = Field(
        True,
        description="Also justified when the best full-precision choice is predicted to miss the slo.tpot_ms target.",
    )
    min_speedup: float = Field(
        1.05, gt=0, description="Predicted speedup over the best full-precision choice required to quantize."
    )

    def meets_floor(self, agreement: float) -> bool:
        """Whether a measured token agreement is good enough to serve (the quality floor)."""
        return agreement >= self.min_agreement


class SLOConfig(_Section):
    ttft_ms: float | None = Field(
        2000.0, gt=0, description="Time-to-first-token target in milliseconds; null: no target."
    )
    tpot_ms: float | None = Field(
        250.0, gt=0, description="Time-per-output-token target in milliseconds; null: no target."
    )


class BottleneckConfig(_Section):
    compute_bound_elasticity: float = Field(
        0.5,
        gt=0,
        lt=1,
        description=(
            "Decode is called compute-bound at concurrency b where the measured step time t grows faster than "
            "b**elasticity (d log t / d log b >= this); 0 would call any growth compute-bound, 1 only linear growth."
        ),
    )
    skip_speculation_when_compute_bound: bool = Field(
        False,
        description=(
            "true: never speculate where decode is compute-bound. false: speculate there too when the cost model, "
            "which prices the wider verify pass at this load (v(b, k)), still predicts speculation.min_speedup."
        ),
    )


class CalibrationConfig(_Section):
    enabled: bool = Field(
        False,
        description="Scale each backend's predicted times by what finished requests measured in this service (per "
        "backend and load), and explore a backend not yet measured at a load. Off by default: on a 2-core machine it "
        "did not route better (docs/concepts/stages.md); the factors are measured and shown in /healthz either way.",
    )
    window: int = Field(
        16, ge=1, le=1024, description="Finished requests kept per backend and load (their median rules)."
    )
    min_observations: int = Field(
        3, ge=1, le=64, description="Requests a backend needs measured at a load before its own factor is used there."
    )
    explore_within: float | None = Field(
        0.8,
        gt=0,
        le=1,
        description="Send a request to a backend not yet measured at this load when its predicted tokens/s is at "
        "least this share of the choice's; null: never explore.",
    )


class PolicyConfig(_Section):
    version: Literal[1] = Field(1, description="Schema version of this file; this specroute reads version 1.")
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig, description="Speculative decoding.")
    batching: BatchingConfig = Field(default_factory=BatchingConfig, description="Large-batch plain decoding.")
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig, description="The quantized backend.")
    slo: SLOConfig = Field(default_factory=SLOConfig, description="Latency targets per request.")
    bottleneck: BottleneckConfig = Field(default_factory=BottleneckConfig, description="Bottleneck classification.")
    calibration: CalibrationConfig = Field(
        default_factory=CalibrationConfig, description="Correcting the profile with the service's own measurements."
    )
    concurrency_override: int | None = Field(
        None,
        ge=1,
        description="Decide as if this many requests were in flight (capacity planning, tests); null: live load.",
    )

    @field_validator("speculation", "batching", "quantization", "slo", "bottleneck", "calibration", mode="before")
    @classmethod
    def _empty_section(cls, value: object) -> object:
        # `slo:` with every child commented out is YAML null; it means "defaults", not "no section".
        return {} if value is None else value

    @model_validator(mode="after")
    def _has_fallback(self) -> PolicyConfig:
        if not (self.speculation.enabled or self.batching.enabled):
            raise PydanticCustomError(
                RULE_ERROR,
                "at least one must be true (plain decoding is the fallback every other choice is compared with)",
                {"path": "speculation.enabled, batching.enabled"},
            )
        return self

    def to_yaml(self) -> str:
        """The policy as YAML (no comments) that `policy_from_yaml` reads back to an equal policy."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def default_policy() -> PolicyConfig:
    """The built-in policy; deploy/policy.yaml spells out the same values with comments."""
    return PolicyConfig()


def parse_policy(data: object, source: str = "policy") -> PolicyConfig:
    """Validate already-parsed YAML/JSON data; None (an empty file) gives the defaults."""
    if data is None:
        return PolicyConfig()
    if not isinstance(data, Mapping):
        sections = ", ".join(PolicyConfig.model_fields)
        raise PolicyError(
            source, [f"the top level must be a mapping with keys {sections}; got {type(data).__name__} {_short(data)}"]
        )
    try:
        return PolicyConfig.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(source, [describe_error(e, PolicyConfig) for e in exc.errors()]) from None


def policy_from_yaml(text: str, source: str = "policy") -> PolicyConfig:
    """Parse and validate a policy given as YAML text."""
    try:
        data = yaml.load(text, Loader=StrictLoader)  # a SafeLoader: builds plain data only
    except yaml.MarkedYAMLError as exc:
        raise PolicyError(source, [yaml_problem(exc)]) from None
    except yaml.YAMLError as exc:
        raise PolicyError(source, [f"not valid YAML: {exc}"]) from None
    return parse_policy(data, source)


def load_policy(path: str | Path) -> PolicyConfig:
    """Read, parse and validate a policy file; every failure is a PolicyError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PolicyError(str(path), ["file not found"]) from None
    except IsADirectoryError:
        raise PolicyError(str(path), ["is a directory, not a YAML file"]) from None
    except UnicodeDecodeError as exc:
        raise PolicyError(str(path), [f"not UTF-8 text (byte {exc.start})"]) from None
    except OSError as exc:
        raise PolicyError(str(path), [f"cannot be read: {exc.strerror or exc}"]) from None
    return policy_from_yaml(text, source=str(path))


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: PyYAML would silently keep the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
    context = f" ({exc.context})" if exc.context else ""
    return f"YAML syntax error at {where}: {exc.problem}{context}"


def describe_error(error: ErrorDetails, root: type[BaseModel]) -> str:
    """One `<dotted.path>: <what is wrong>` line for a pydantic error of the file `root` validates
    (the policy here, the workload file in `policies.workload`)."""
    loc = error["loc"]
    ctx = error.get("ctx") or {}
    path = ctx.get("path") or _dotted(loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{path}: {_unknown_key(loc, root)}"
    if error["type"] == RULE_ERROR:
        return f"{path}: {error['msg']}"
    if error["type"] == "model_type" and (section := _section_at(loc, root)) is not None:
        # pydantic would name the class; the user needs the keys the section takes.
        return f"{path}: should be a mapping with keys {', '.join(section.model_fields)} (got {_short(error['input'])})"
    return f"{path}: {error['msg']} (got {_short(error['input'])})"


def _unknown_key(loc: tuple[int | str, ...], root: type[BaseModel]) -> str:
    section = _section_at(loc[:-1], root)
    if section is None:
        return "unknown key"
    allowed = list(section.model_fields)
    message = f"unknown key (allowed: {', '.join(allowed)})"
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    return f"{message}; did you mean {close[0]}?" if close else message


def _section_at(loc: tuple[int | str, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    """The model class that validates the mapping at `loc`, or None if `loc` leads elsewhere."""
    model: type[BaseModel] = root
    for key in loc:
        field = model.model_fields.get(str(key))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _dotted(loc: tuple[int | str, ...]) -> str:
    # List positions read as drafters[1], so the path matches what the user sees in the YAML.
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
