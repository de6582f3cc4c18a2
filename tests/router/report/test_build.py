"""The report built from real measurements: the profile the service's first start measured on
this project's 2-core AMD EPYC machine and the `bench load` sweeps run against that service right
after (fixtures/README.md says how), so the simulation is checked against what really happened.
No model weights are loaded (a JSONL workload loads the tokenizer only)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from policies.capacity import RunSummary
from policies.config import default_policy
from policies.profile import Profile
from router.cli import main
from router.load_report import LoadReport
from router.report import latest_dir, measure
from router.report.build import build_report
from router.report.data import Report
from router.report.inputs import ReportConfig, ReportError, _other_engine, read_inputs
from router.report.render import load_report, render_html, render_markdown, write_report
from router.report.simulate import SIM_TOLERANCE, fewest_replicas, validate
from tests.chromium import render

FIXTURES = Path(__file__).parent / "fixtures"
PROFILE = FIXTURES / "profile.json"
LOADS = [FIXTURES / "bench-load-closed.json", FIXTURES / "bench-load-open.json"]
SPEC, FIT = FIXTURES / "bench-spec.json", FIXTURES / "bench-model-fit.json"
WORKLOAD = Path(__file__).resolve().parents[3] / "deploy" / "workload.yaml"
SMALL = {"requests": 300, "max_replicas": 16}


@pytest.fixture(scope="module")
def profile() -> Profile:
    return Profile.load(PROFILE)


@pytest.fixture(scope="module")
def loads() -> list[LoadReport]:
    return [LoadReport.model_validate_json(p.read_text()) for p in LOADS]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Report, Path]:
    out = tmp_path_factory.mktemp("report")
    config = ReportConfig(
        workload=str(WORKLOAD),
        out=str(out),
        profile=str(PROFILE),
        load_results=[str(p) for p in LOADS],
        bench_spec=str(SPEC),
        model_fit=str(FIT),
        **SMALL,
    )
    report = build_report(config, progress=False)
    write_report(report, out)
    return report, out


def test_the_simulation_replays_the_measured_load_sweeps_within_its_tolerance(profile, loads):
    validation, skipped = validate(profile, default_policy(), loads)
    assert skipped == []
    cells = [c for load in loads for c in load.cells if c.batching == "continuous"]
    assert len(validation.rows) == len(cells)
    assert {(r.level, r.mode) for r in validation.rows} == {(c.level.label, c.mode) for c in cells}
    assert validation.mean_abs_tokens_error is not None
    assert validation.mean_abs_tokens_error <= SIM_TOLERANCE
    assert validation.within_tolerance is True


def test_the_report_writes_the_page_the_plots_and_report_json(written):
    report, out = written
    for name in ("report.html", "report.md", "report.json"):
        assert (out / name).stat().st_size > 1000
    assert {p.name for p in report.plots} >= {"heatmap.png", "concurrency.png", "load.png", "validation.png"}
    for plot in report.plots:
        assert (out / plot.name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [i.status for i in report.inputs if i.name == "bench load"] == ["read", "read"]
    assert {i.name: i.status for i in report.inputs}["bench spec"] == "read"
    assert all(p.measured is not None and p.k == 4 for p in report.heatmap.points)  # bench spec ran k = 4
    assert all(c.measured and c.measured_batches_max == 16 for c in report.curves)  # model-fit to b = 16
    assert {s.backend for s in report.sizing} == {"auto", "speculative", "plain", "quantized"}
    assert report.recommendation.headline and report.recommendation.reasons


def test_sizing_meets_the_slo_it_reports(written):
    report, _ = written
    target = report.workload.slo["attainment"]
    for row in report.sizing:
        if row.replicas is not None:
            assert row.attainment >= target
            assert row.e2e_p99_ms <= report.workload.slo["e2e_p99_ms"]
            assert row.usd_per_million_tokens is not None and row.usd_per_million_tokens > 0
        assert row.memory.weights_bytes and row.memory.kv_bytes is not None
    quantized = next(s for s in report.sizing if s.backend == "quantized")
    assert not quantized.eligible  # the profiled int8 model is under the policy's quality floor
    assert report.recommendation.backend != "quantized"


def test_the_page_is_a_function_of_report_json(written):
    report, out = written
    again = load_report(out / "report.json")
    assert again == report
    assert render_markdown(again) == (out / "report.md").read_text()
    assert render_html(again, out) == (out / "report.html").read_text()


def test_every_number_on_the_page_is_a_figure_of_report_json(written):
    _, out = written
    figures = json.loads((out / "report.json").read_text())
    shown = re.findall(r"\d+(?:\.\d+)?", (out / "report.md").read_text())
    strings = " ".join(_strings(figures))
    values = list(_numbers(figures))
    unexplained = [n for n in shown if n not in strings and not any(_shows(v, n) for v in values)]
    assert not unexplained, f"numbers on the page that report.json does not hold: {unexplained[:20]}"


def _strings(value: object):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _numbers(value: object):
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield float(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


def _shows(value: float, text: str) -> bool:
    """Whether `text` is `value` as the page prints it: rounded, as a percentage, or in MiB."""
    digits = len(text.split(".")[1]) if "." in text else 0
    for scaled in (value, value * 100, value / 2**20, abs(value), abs(value) * 100):
        if f"{scaled:.{digits}f}" == text:
            return True
    return False


def test_the_html_renders_in_headless_chromium_with_every_image_loaded(written, tmp_path):
    report, out = written
    rendered = render(out / "report.html", tmp_path)
    assert not rendered.blank
    assert len(rendered.images) == len(report.plots)
    assert rendered.missing == []


def test_a_broken_image_fails_the_render_check(written, tmp_path):
    _, out = written
    page = tmp_path / "report.html"
    html = (out / "report.html").read_text()
    page.write_text(html.replace("data:image/png;base64,iVBOR", "data:image/png;base64,AAAA", 1))
    assert len(render(page, tmp_path).missing) == 1


def test_with_only_a_profile_the_report_names_what_is_missing(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "profiles").mkdir(parents=True)
    shutil.copy(PROFILE, home / "profiles" / "embedded-float32-cpu.json")
    monkeypatch.setenv("SPECROUTE_HOME", str(home))
    monkeypatch.chdir(tmp_path)  # no bench results here
    # What is missing is named whatever the simulation's size: a third of the requests will do.
    config = ReportConfig(workload=str(WORKLOAD), out=str(tmp_path / "out"), **{**SMALL, "requests": 100})
    report = build_report(config, progress=False)
    write_report(report, tmp_path / "out")
    status = {i.name: i.status for i in report.inputs}
    assert status["profile"] == "read"
    for bench in ("bench load", "bench spec", "bench model-fit"):
        assert status[bench].startswith("missing: run `specroute")
    assert status["llama.cpp engine profile"] == "missing: run `specroute profile --engine llamacpp`"
    assert report.validation.rows == [] and report.validation.within_tolerance is None
    assert "not validated" in report.recommendation.uncertainty[0]
    assert {p.name for p in report.plots}.isdisjoint({"load.png", "validation.png"})
    assert report.what_if and report.sizing


def test_the_default_profile_is_what_iffed_beside_the_other_engines(tmp_path, monkeypatch, profile):
    home = tmp_path / "home"
    (home / "profiles").mkdir(parents=True)
    shutil.copy(PROFILE, home / "profiles" / "embedded-float32-cpu.json")
    model = profile.model.model_copy(update={"engine": "llamacpp", "gguf_weights": "file"})
    llama = profile.model_copy(update={"model": model})
    (home / "profiles" / "embedded-llamacpp-file-cpu.json").write_text(llama.model_dump_json())
    monkeypatch.setenv("SPECROUTE_HOME", str(home))
    inputs = read_inputs(ReportConfig(workload=str(WORKLOAD), out=str(tmp_path / "out")))
    assert [label for label, _ in inputs.compare] == ["this machine on llama.cpp (llama.cpp file)"]
    assert {i.name: i.status for i in inputs.files}["llama.cpp engine profile"] == "read"
    config = ReportConfig(workload=str(WORKLOAD), out=str(tmp_path / "out"), other_engine=False)
    assert read_inputs(config).compare == []
    # and beside a llama.cpp profile, torch's
    assert [label for label, _ in _other_engine(llama, [])] == ["this machine on torch (float32)"]


def test_fewest_replicas_bisects_to_the_smallest_count_that_meets_the_slo():
    calls: list[int] = []

    def run(n: int) -> RunSummary:
        calls.append(n)
        return RunSummary(10, 1.0, (0, 0, 0), (0, 0, 0), (0, 0, 0), min(1.0, n / 11), 0.5, 1.0, 1)

    replicas, summary = fewest_replicas(run, lambda s: s.attainment >= 1.0, most=64)
    assert replicas == 11 and summary.attainment == 1.0
    assert len(calls) == len(set(calls)) <= 9  # 1, 2, 4, 8, 16, then bisection
    none, largest = fewest_replicas(run, lambda s: False, most=5)
    assert none is None and calls[-1] == 5
    calls.clear()  # a higher load's search: 10 known short (the fewest at 1× less one), 12 guessed
    assert fewest_replicas(run, lambda s: s.attainment >= 1.0, most=64, short=10, guess=12)[0] == 11
    assert calls == [12, 11]
    calls.clear()
    assert fewest_replicas(run, lambda s: s.attainment >= 1.0, most=64, short=2, guess=3)[0] == 11
    assert calls[:3] == [3, 6, 12] and 11 in calls and all(n > 2 for n in calls)


def test_a_jsonl_workload_is_rated_prompt_by_prompt(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "Repeat exactly: the cat sat on the mat. the cat sat on the mat."}]},
        {"messages": [{"role": "user", "content": "Write a haiku about caches."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]},
    ]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    workload = tmp_path / "w.yaml"
    workload.write_text("prompts: prompts.jsonl\nload: {concurrency: [1, 4]}\nwhat_if: {replicas: [1]}\n")
    config = ReportConfig(workload=str(workload), out=str(tmp_path / "out"), profile=str(PROFILE), **SMALL)
    report = build_report(config, progress=False)
    assert report.workload.prompts_rated == 3
    assert report.workload.concurrency == [1, 4]
    assert report.sizing and all(s.attainment > 0 for s in report.sizing)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no messages"}\n')
    workload.write_text("prompts: bad.jsonl\nload: {concurrency: [1, 4]}\n")
    with pytest.raises(ReportError, match=r"bad.jsonl:1: not an OpenAI chat request"):
        build_report(config, progress=False)


def test_measure_runs_only_what_is_missing(tmp_path, monkeypatch):
    ran: list[str] = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(measure, "_ensure_profile", lambda log: ran.append("profile"))
    monkeypatch.setattr(measure, "_bench_spec", lambda path, log: ran.append("spec") or str(path))
    monkeypatch.setattr(measure, "_model_fit", lambda path, profile, log: ran.append("fit") or str(path))
    ports: list[int] = []

    def fake_load(path, url, port, profile, log):
        ran.append("load")
        ports.append(port)
        assert profile == "p.json"  # a service it starts routes with the report's profile
        return str(path)

    monkeypatch.setattr(measure, "_bench_load", fake_load)
    config = ReportConfig(workload="w.yaml", out=str(tmp_path / "out"), profile="p.json", model_fit="f.json")
    measured = measure.measure_missing(config, "http://127.0.0.1:8123", log=lambda _: None)
    assert ran == ["spec", "load"] and ports == [8123]
    assert measured.bench_spec == str(tmp_path / "out" / "bench-spec.json")
    assert measured.load_results == [str(tmp_path / "out" / "bench-load.json")]
    assert measured.model_fit == "f.json"


def test_the_cli_writes_the_report_and_publishes_it_for_the_service(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    args = ["report", "--workload", str(WORKLOAD), "--out", str(out), "--profile", str(PROFILE)]
    args += ["--load-results", str(LOADS[0]), "--requests", "200", "--max-replicas", "8"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    report = load_report(out / "report.json")
    assert report.recommendation.headline in printed
    assert (latest_dir() / "report.html").read_text() == (out / "report.html").read_text()
    assert (
        main(["report", "--workload", str(tmp_path / "none.yaml"), "--out", str(out), "--profile", str(PROFILE)]) == 2
    )
    assert "file not found" in capsys.readouterr().err


def test_the_heatmap_markers_predict_what_the_equations_do_at_the_same_k(written):
    report, _ = written
    for point in report.heatmap.points:
        same = [e for e in report.equations if e.category == point.category and e.drafter == report.heatmap.drafter]
        assert len(same) == 1
        if same[0].k == point.k:  # the best k at batch 1 is the k acceptance was measured at
            assert point.predicted == pytest.approx(same[0].speedup)
        assert point.predicted <= same[0].speedup + 1e-9  # the equations' k is the best one
        assert point.proposal_rate == same[0].proposal_rate


def test_a_replica_without_a_price_is_one_machine_at_the_core_hour_rate(profile):
    from policies.workload import parse_workload
    from router.report.simulate import replica_price

    workload = parse_workload({"mix": {"chat": 1.0}, "load": {"arrival_rate": 1}, "pricing": {"core_hour_usd": 0.05}})
    for mode in ("auto", "plain"):
        price = replica_price(mode, workload, profile)
        assert price.replica_hour_usd == pytest.approx(2 * 0.05) and price.assumed_cores == 2
    given = parse_workload(
        {"mix": {"chat": 1.0}, "load": {"arrival_rate": 1}, "pricing": {"replica_hour_usd": {"auto": 0.3}}}
    )
    assert replica_price("auto", given, profile).replica_hour_usd == 0.3
    assert replica_price("auto", given, profile).assumed_cores is None


def test_the_policy_decides_which_backends_may_be_recommended(profile):
    from policies.config import PolicyConfig
    from router.report.simulate import _ineligible

    assert _ineligible("quantized", profile, default_policy()) == "below quality floor"  # 80.7% < 95%
    lenient = PolicyConfig(quantization={"min_agreement": 0.5})
    assert _ineligible("quantized", profile, lenient) is None
    assert _ineligible("speculative", profile, PolicyConfig(speculation={"enabled": False})) == "disabled by the policy"
    assert _ineligible("auto", profile, PolicyConfig(speculation={"enabled": False})) is None


def test_the_recommendation_is_the_cheapest_allowed_size_padded_by_the_measured_bias(written, profile):
    from router.report.recommend import mode_bias, recommend

    report, _ = written
    chosen = recommend(report, profile, default_policy())
    allowed = [s for s in report.sizing if s.eligible and s.replicas is not None]
    cheapest = min(s.replicas * s.replica_hour_usd for s in allowed)
    row = next(s for s in report.sizing if s.backend == chosen.backend)
    assert row.eligible and row.replicas * row.replica_hour_usd == cheapest
    bias = mode_bias(report.validation, chosen.backend)
    assert chosen.bias == bias
    if bias is not None and bias > 0:
        assert chosen.replicas_with_bias >= chosen.replicas
    cheaper_but_banned = report.model_copy(deep=True)
    for s in cheaper_but_banned.sizing:
        if s.backend == "quantized":
            s.replicas, s.replica_hour_usd = 1, 0.001
    assert recommend(cheaper_but_banned, profile, default_policy()).backend != "quantized"


def test_cells_the_profile_cannot_replay_are_named_and_another_models_results_refused(profile, loads):
    no_int8 = profile.model_copy(update={"quantized": None})
    validation, skipped = validate(no_int8, default_policy(), loads)
    assert skipped and all("quantized not replayed: the profile measured no quantized backend" in s for s in skipped)
    assert all(row.mode != "quantized" for row in validation.rows)
    other = loads[0].model_copy(update={"model": "another-model"})
    with pytest.raises(ReportError, match="measured another-model, the profile SmolLM2-135M-Instruct"):
        validate(profile, default_policy(), [other])


def test_a_shared_prefix_goes_before_every_drawn_prompt_and_into_the_simulation(profile):
    from policies.workload import Workload
    from router.report.simulate import draw_traffic

    fields = {"mix": {profile.categories[0]: 1.0}, "load": {"concurrency": [1, 4]}}
    plain = draw_traffic(Workload.model_validate(fields), profile, 6, seed=3)
    shared = draw_traffic(Workload.model_validate({**fields, "shared_prefix": 300}), profile, 6, seed=3)
    for before, after in zip(plain.requests, shared.requests, strict=True):
        assert (after.prompt_tokens, after.shared_prefix) == (before.prompt_tokens + 300, 300)
        assert after.to_prefill(warm=True) < after.prompt_tokens == after.to_prefill(warm=False)
