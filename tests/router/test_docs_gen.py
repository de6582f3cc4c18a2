"""The generated reference: the committed pages equal a fresh generation, every flag, config field
and metric appears in its page, the checked-in YAML files validate against the generated schemas,
results render with their provenance, and the MkDocs site builds and renders."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

from backends.loop_metrics import HistogramSnapshot, LoopSnapshot
from profiler.results import Provenance, ResultFile
from router import docs_gen
from router.cli import build_parser
from router.docs_gen import CONFIG_FILES, MARKERS, REGENERATE, ROOT, DocsError
from router.metrics import LoopFamilies, ServiceMetrics
from tests.chromium import render

FIXTURES = ROOT / "tests/router/report/fixtures"
PROVENANCE = Provenance(
    command="specroute bench spec --prompts 1",
    cpu="Test CPU 9000",
    logical_cores=2,
    started="2026-12-01T10:00:00+00:00",
    finished="2026-12-01T10:05:00+00:00",
    revision="0123456789abcdef0123456789abcdef01234567",
    dirty=False,
)


def committed(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def test_committed_generated_files_equal_a_fresh_generation():
    stale = docs_gen.stale(ROOT)
    assert not stale, f"generated docs are stale ({', '.join(stale)}): {REGENERATE}"


def test_generated_files_hold_nothing_of_the_machine_that_generated_them():
    files = docs_gen.generate(ROOT)
    for path, text in files.items():
        if path != docs_gen.README:  # the README's hand-written part is not generated
            assert str(ROOT) not in text and str(Path.home()) not in text, path


def _sections(page: str) -> dict[str, str]:
    """The cli page's sections by command (`specroute bench plain`)."""
    parts = page.split("\n## `")[1:]
    return {part.split("`", 1)[0]: part for part in parts}


def _commands(parser: argparse.ArgumentParser) -> typing.Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _commands(sub)


def test_every_flag_of_every_command_appears_in_its_section_of_cli_md():
    sections = _sections(committed("docs/reference/cli.md"))
    commands = list(_commands(build_parser()))
    assert {"specroute bench plain", "specroute serve", "specroute report", "specroute train-drafter"} <= {
        c.prog for c in commands
    }
    for command in commands:
        section = sections[command.prog]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            for name in action.option_strings or [action.dest]:
                assert f"`{name}`" in section, f"{command.prog} {name} is missing from cli.md"
            if action.help:
                assert " ".join(action.help.split()).replace("|", "\\|") in section


def _field_paths(model: type[BaseModel], prefix: str = "") -> typing.Iterator[str]:
    """Every field of `model` as a dotted path, into nested models: nullable ones, and the items
    of lists (`[]` per list)."""
    for name, field in model.model_fields.items():
        yield prefix + name
        for inner, suffix in _models_in(field.annotation):
            yield from _field_paths(inner, f"{prefix}{name}{suffix}.")


def _models_in(annotation: object, suffix: str = "") -> typing.Iterator[tuple[type[BaseModel], str]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, suffix
    elif typing.get_origin(annotation) is list:
        yield from _models_in(typing.get_args(annotation)[0], suffix + "[]")
    elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            yield from _models_in(option, suffix)


@pytest.mark.parametrize("config", CONFIG_FILES, ids=lambda c: c.name)
def test_every_field_of_a_config_file_appears_in_its_page(config):
    page = committed(f"docs/reference/{config.name}.md")
    paths = list(_field_paths(config.model()))
    assert len(paths) > 10
    missing = [path for path in paths if f"| `{path}` |" not in page]
    assert not missing, f"{config.name}.md lacks {missing}"


def _serve_yaml() -> dict:
    return yaml.safe_load(committed("deploy/serve.yaml"))


def _schema(name: str) -> dict:
    schema = json.loads(committed(f"docs/schema/{name}.json"))
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == docs_gen.JSON_SCHEMA_DIALECT and schema["title"].startswith("specroute")
    return schema


def test_the_deploy_files_validate_against_the_generated_schemas():
    serve = _serve_yaml()["applications"][0]
    examples = {
        "policy": [yaml.safe_load(committed("deploy/policy.yaml")), serve["deployments"][0]["user_config"]["policy"]],
        "workload": [yaml.safe_load(committed("deploy/workload.yaml"))],
        "serve": [serve["args"]],
    }
    for name, documents in examples.items():
        for document in documents:
            jsonschema.validate(document, _schema(name))


@pytest.mark.parametrize(
    "name, document",
    [
        ("policy", {"speculation": {"k_maxx": 4}}),
        ("policy", {"speculation": {"drafters": ["telepathy"]}}),
        ("workload", {"mix": {"chat": 1.0}}),  # load is required
        ("serve", {"backend": {"threads": 0}}),
    ],
)
def test_the_generated_schemas_refuse_what_the_models_refuse(name, document):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, _schema(name))
    model = next(c for c in CONFIG_FILES if c.name == name).model()
    with pytest.raises(ValueError):
        model.model_validate(document)


def test_every_field_table_renders_defaults_the_code_declares():
    page = committed("docs/reference/policy.md")
    assert "| `speculation.k_max` | integer | `8` | ≥ 1; ≤ 32 |" in page
    assert '| `speculation.drafters` | list of string | `["ngram", "model"]` |' in page  # a default factory
    workload = committed("docs/reference/workload.md")
    # A section whose default differs from its fields' own defaults shows it: omitted, max is 512, not 2048.
    assert (
        '| `output_tokens` | mapping | `{"distribution": "lognormal", "mean": 128.0, "min": 1, "max": 512,' in workload
    )
    assert "| `output_tokens.max` | integer | `2048` |" in workload
    assert "| `input_tokens` | mapping, or null | `null` |" in workload


def _served_metric_names() -> set[str]:
    """The family names a /metrics scrape shows, from the registry itself."""
    metrics = ServiceMetrics(ray_export=False)
    histogram = HistogramSnapshot(buckets=[1.0], cumulative=[1], sum=1.0, count=1)
    loop = LoopSnapshot(
        backend="plain", running=1, waiting=0, kv_cache_usage=0.1, batch_size=histogram, tokens=histogram
    )
    families = [*metrics.registry.collect(), *LoopFamilies([loop]).collect()]
    return {f.name + "_total" if f.type == "counter" else f.name for f in families}


def test_every_metric_the_service_serves_appears_in_metrics_md():
    page = committed("docs/reference/metrics.md")
    names = _served_metric_names()
    assert {"vllm:time_to_first_token_seconds", "specroute_requests_total", "vllm:num_requests_running"} <= names
    missing = [name for name in names if f"| `{name}` |" not in page]
    assert not missing, f"metrics.md lacks {missing}"


def _result(kind: str, result: dict) -> ResultFile:
    return ResultFile(kind=kind, provenance=PROVENANCE, result=result)


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_a_bench_spec_result_renders_its_speedups_and_the_run_that_measured_them():
    data = _fixture("bench-spec.json")
    page = docs_gen.results_page([("spec-small", _result("bench spec", data))])
    best = max(v for k, v in data["geomean_speedup"].items() if not k.startswith("plain"))
    assert f"{best:.2f}×" in page
    assert (
        "run: `specroute bench spec --prompts 1` on Test CPU 9000 (2 logical cores), 2026-12-01, rev 0123456789" in page
    )
    assert "[Raw JSON](../results/spec-small.json)" in page and "busy" not in page


def test_a_run_on_a_busy_machine_says_so_beside_its_figures():
    busy = ResultFile(
        kind="bench spec",
        provenance=PROVENANCE.model_copy(update={"load_average": 3.5}),
        result=_fixture("bench-spec.json"),
    )
    assert "The machine was busy as it started (load average 3.5)" in docs_gen.results_page([("s", busy)])
    assert all(
        "busy (load 3.5)" in row for row in docs_gen.readme_region([("s", busy)]).splitlines() if "`specroute" in row
    )


def _faults_report() -> dict:
    from router.fault_models import FaultEvent, FaultRequestRecord, FaultsConfig, build_report

    def record(index: int, phase: str, **fields) -> FaultRequestRecord:
        base = {"category": "chat", "prompt_id": f"p{index}", "stream": False, "greedy": True, "outcome": "ok"}
        base |= {"status": 200, "text": f"answer {index}", "backend": "plain", "weights": "float32"}
        return FaultRequestRecord(index=index, phase=phase, start_s=index, end_s=index + 1.0, **{**base, **fields})

    before = [record(i, "undisturbed") for i in range(8)]
    after = [record(i, "faulted", **({"outcome": "lost", "status": None} if i == 3 else {})) for i in range(8)]
    event = FaultEvent(fault="plain", fired_after=2, fired_s=2.5, pid=1, recovered_s=4.0)
    runs = {"undisturbed": (before, 9.0), "faulted": (after, 9.0)}
    return build_report(FaultsConfig(requests=8, faults=["plain"]), "m", "float32", "now", runs, [event]).model_dump()


def _invariance_report() -> dict:
    from profiler.bench_invariance import Agreement, BenchInvarianceReport, PlainSpeed
    from profiler.hardware import MachineInfo

    machine = MachineInfo(
        cpu="Test CPU 9000", logical_cores=2, torch_threads=2, torch_version="t", transformers_version="t",
        python_version="3.11", cuda_device=None,
    )  # fmt: skip
    agreements = [
        Agreement(width_invariant="alone", compared="plain vs speculative", batch_size=4, prompts=6, identical=5)
    ]
    speeds = [PlainSpeed(width_invariant="alone", tile=9, tokens_per_s=10.0, batch_size=4, batched_tokens_per_s=30.0)]
    report = BenchInvarianceReport(machine=machine, model={}, drafter="ngram", agreements=agreements, speeds=speeds)
    return report.model_dump()


def _capacity_report() -> dict:
    from tests.router.report.sample import sample_report

    return sample_report().model_dump()


@pytest.mark.parametrize(
    "kind, data, figure",
    [
        ("bench spec", lambda: _fixture("bench-spec.json"), "speculative decoding, best geomean speedup"),
        ("bench model-fit", lambda: _fixture("bench-model-fit.json"), "cost model: mean abs. error"),
        ("bench load", lambda: _fixture("bench-load-closed.json"), "router tokens/s over the best fixed backend"),
        ("bench faults", _faults_report, "faults under load: requests lost"),
        ("bench invariance", _invariance_report, "greedy output identical to plain decoding alone"),
        ("report", _capacity_report, "capacity report"),
    ],
)
def test_every_kind_of_result_renders_a_table_and_headline_figures_with_their_command(kind, data, figure):
    result = _result(kind, data())
    rendered = docs_gen.RENDERERS[kind](result.result)
    assert rendered.tables and all(table.strip() for table in rendered.tables)
    region = docs_gen.readme_region([("x", result)])
    row = next(line for line in region.splitlines() if figure in line)
    assert "`specroute bench spec --prompts 1`" in row and "Test CPU 9000, 2026-12-01" in row


def test_the_model_fit_error_is_shown_as_the_percentage_it_already_is():
    data = _fixture("bench-model-fit.json")
    headlines = dict(docs_gen.RENDERERS["bench model-fit"](data).headlines)
    assert headlines["cost model: mean abs. error of predicted speedup (run's α)"] == f"{data['mape']:.1f}%"


def test_the_faults_headline_counts_the_lost_request():
    rendered = docs_gen.RENDERERS["bench faults"](_faults_report())
    assert ("faults under load: requests lost", "1 of 8") in rendered.headlines


def test_a_result_the_renderer_cannot_read_is_refused_with_its_file(tmp_path):
    (tmp_path / docs_gen.RESULTS_DIR).mkdir(parents=True)
    (tmp_path / docs_gen.RESULTS_DIR / "bad.json").write_text('{"kind": "bench plain", "result": {}}')
    with pytest.raises(DocsError, match="docs/results/bad.json"):
        docs_gen.read_results(tmp_path)


def test_the_readme_region_is_replaced_between_the_markers_and_nowhere_else():
    start, end = MARKERS
    readme = f"# title\n\nintro\n{start}\nold table\n{end}\n\nrest\n"
    updated = docs_gen.with_region(readme, "NEW")
    assert updated == f"# title\n\nintro\n{start}\nNEW\n{end}\n\nrest\n"
    assert docs_gen.with_region(updated, "NEW") == updated


@pytest.mark.parametrize("readme", ["# no markers\n", f"{MARKERS[1]}\n{MARKERS[0]}\n", f"{MARKERS[0]}\n" * 2])
def test_a_readme_without_its_markers_is_refused_naming_them(readme):
    with pytest.raises(DocsError, match="results:start"):
        docs_gen.with_region(readme, "NEW")


def test_check_exits_1_and_names_a_stale_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(docs_gen, "stale", lambda root=ROOT: ["docs/reference/cli.md"])
    assert docs_gen.main(["--check"]) == 1
    assert "stale: docs/reference/cli.md" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, kind, capture",
    [
        (["specroute", "bench", "plain", "--json", "--batches", "1"], "bench plain", True),
        ([".venv/bin/specroute", "bench", "spec", "--prompts", "1"], "bench spec", False),
        (["specroute", "bench", "load", "--out", "-", "--json"], "bench load", True),
        (["specroute", "report", "--workload", "w.yaml", "--out", "r"], "report", False),
    ],
)
def test_a_recording_reads_the_json_where_the_command_writes_it(argv, kind, capture):
    found_kind, _, found_capture = docs_gen.recording_plan(argv)
    assert (found_kind, found_capture) == (kind, capture)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["specroute", "bench", "plain"], "add --json"),
        (["specroute", "generate", "hi"], "writes no result"),
        (["python", "bench.py"], "runs a specroute command"),
        (["specroute", "bench", "plain", "--bogus"], "not a valid"),
    ],
)
def test_a_command_that_gives_no_result_is_refused_before_it_runs(argv, message):
    with pytest.raises(DocsError, match=message):
        docs_gen.recording_plan(argv)


@pytest.mark.parametrize("name", ["Bench Plain", "../escape", ""])
def test_a_result_name_must_be_a_plain_slug(name, tmp_path):
    with pytest.raises(DocsError, match="result name"):
        docs_gen.record(name, ["specroute", "bench", "plain", "--json"], tmp_path)


def test_a_result_file_the_run_did_not_write_is_not_recorded(tmp_path):
    old = tmp_path / "bench-spec.json"
    old.write_text("{}")
    _, read, _ = docs_gen.recording_plan(["specroute", "bench", "spec", "--out", str(old)])
    with pytest.raises(DocsError, match="did not write"):
        read(None)


def test_the_site_builds_strictly_and_its_front_page_renders(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for page in ("reference/cli", "reference/policy", "reference/metrics", "benchmarks/results"):
        assert (site / page / "index.html").is_file(), page
    rendered = render(site / "index.html", tmp_path / "shot")
    assert not rendered.blank


def test_the_readme_is_a_short_entry_whose_links_all_resolve():
    """The README stays a page read in minutes (the reference lives in docs/): at most 250 lines,
    the two set-up commands in it, and every relative link or image pointing at a file that exists."""
    readme = committed("README.md")
    assert len(readme.splitlines()) <= 250
    assert "make run " in readme and "make test " in readme
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert "docs/images/capacity-speedup.png" in local
    assert [t for t in local if not (ROOT / t).exists()] == []


def test_a_bench_plain_result_shows_each_llama_cpp_weight_type_with_its_quality_and_probe():
    data = _fixture("bench-plain-llamacpp.json")
    rendered = docs_gen.RENDERERS["bench plain"](data)
    table = rendered.tables[-1].splitlines()
    assert "Passes invariant" in table[0] and "Agreement with float" in table[0]
    for weights in data["llamacpp"]["weights"]:
        quality = weights["quality"]
        row = next(line for line in table if line.startswith(f"| {weights['weights']} ("))
        assert f"{weights['engine_tokens_per_s']:.1f} ({weights['ratio']:.2f}×)" in row
        assert f"{quality['agreement']:.1%}" in row and ("under floor" in row) != quality["meets_floor"]
        assert ("| **no** |" in row) == (weights["variance"] is not None)
    first = data["llamacpp"]["weights"][0]
    headline = f"llama.cpp engine ({first['weights']} weights), batch 1, over llama.cpp's own generation"
    assert (headline, f"{first['ratio']:.2f}×") in rendered.headlines


def test_a_llama_cpp_bench_spec_result_judges_identity_by_its_speculative_runs_only():
    """Its references — llama.cpp's own generation and the float32 torch loop — are other numerical
    models whose tokens differ; the headline is about speculation against the engine's plain loop."""
    data = _fixture("bench-spec-llamacpp.json")
    runs = [run for category in data["categories"] for run in category["runs"]]
    assert not all(run["identical"] for run in runs)
    assert all(run["identical"] for run in runs if " k=" in run["name"])
    headlines = dict(docs_gen.RENDERERS["bench spec"](data).headlines)
    assert headlines["speculative output identical to plain (greedy, llamacpp engine, Q8_0 weights)"] == "yes"
    best = headlines["speculative decoding, best geomean speedup over plain (batch 1, llamacpp engine, Q8_0 weights)"]
    assert "k=" in best and "llama.cpp generate" not in best
