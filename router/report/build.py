"""`specroute report`: a capacity-planning report from what the profiler and the benches measured.

It measures nothing unless asked (`--measure`): it reads the profile, and `bench load`, `bench
spec` and `bench model-fit` results where it finds them, says which were missing, and fills a
`Report` (report.json) from which the page and every plot are drawn. The what-if half is a
discrete-event simulation of the router and its backends (`policies.simulation`, with backend
models from `policies.capacity`) that is first replayed against every measured `bench load` cell,
so the report shows how far to trust it before using it for more replicas, more load or another
machine's profile.
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np

from policies.capacity import batch_context
from policies.estimates import ProfileCosts
from policies.workload import Workload

from . import data as r
from .inputs import ReportConfig, read_inputs, timestamp
from .recommend import recommend
from .simulate import Runs, Traffic, draw_traffic, read_prompts, size, validate, what_if
from .tradeoff import (
    acceptance_rows,
    concurrency_curves,
    draft_cost_rows,
    equations,
    heatmap,
    load_rows,
    machine_of,
    verify_table,
)


def _workload_summary(workload: Workload, traffic: Traffic, source: str) -> r.WorkloadSummary:
    return r.WorkloadSummary(
        name=workload.name,
        source=source,
        mix=traffic.mix,
        prompts_rated=traffic.rated,
        input_tokens_mean=float(np.mean([q.prompt_tokens for q in traffic.requests])),
        output_tokens_mean=float(np.mean([q.output_tokens for q in traffic.requests])),
        arrival_rate=traffic.arrival_rate,
        concurrency=traffic.concurrency,
        slo={**workload.slo.model_dump()},
        simulated_requests=len(traffic.requests),
    )


NOTES = [
    "Simulated backends are fluid: a speculative row advances its expected tokens per step, with k chosen per step "
    "by the engine's own planner (plan_step) from the profile's α, ρ and cost curves — without the catch-up a "
    "draft model spends reading context it has not seen, and with each drafter's cost at the whole batch.",
    "The quantized backend's prefill is not measured: it is the target's, scaled by the quantized decode step's "
    "share of the target's.",
    "Replays and what-ifs run the step loop's default settings (max_batch, max_step_tokens, prefill_chunk) and the "
    "report's policy; a service run with other settings is replayed as if it had these.",
    "Memory counts weights, drafter weights and the target's KV cache at the busiest simulated moment; a draft "
    "model's own KV cache, activations and the runtime are not counted.",
    "Backends do not compete for cores in the simulation; on a machine where the three replicas share few cores, "
    "a routed run that keeps several busy is slower than simulated.",
    "The router's HTTP and tokenization overhead is not simulated (it is part of the measured TTFT).",
    "The routed service decides with each backend's in-flight count per replica, as the live router does, and "
    "sends a request sharing the workload's prefix to a replica that holds it unless that one runs "
    "`max_imbalance` requests more than the least loaded.",
]


def build_report(config: ReportConfig, progress: bool = True, model: str | None = None) -> r.Report:
    inputs = read_inputs(config)
    profile, policy, workload = inputs.profile, inputs.policy, inputs.workload
    prompts = read_prompts(workload.prompts, profile, workload.output_tokens.max, model) if workload.prompts else ()
    traffic = draw_traffic(workload, profile, config.requests, config.seed, prompts)
    # The tables and equations read the curves at the workload's mean decode context (the simulation per batch).
    costs = ProfileCosts(profile, batch_context(traffic.requests))
    measured, comparisons = load_rows(inputs.loads)
    validation, skipped = validate(profile, policy, inputs.loads)
    report = r.Report(
        created=timestamp(datetime.now(UTC)),
        title=f"specroute capacity plan — {workload.name} on {profile.model.name} ({profile.model.dtype})",
        machine=machine_of(profile),
        inputs=inputs.files,
        workload=_workload_summary(workload, traffic, workload.prompts or config.workload),
        acceptance=acceptance_rows(profile),
        draft_costs=draft_cost_rows(profile, costs),
        verify=verify_table(profile, costs),
        equations=equations(profile, policy, costs),
        heatmap=heatmap(profile, policy, costs, inputs.spec),
        curves=concurrency_curves(profile, policy, costs, inputs.fit),
        load=measured,
        load_comparisons=comparisons,
        validation=validation,
        sizing=[],
        what_if=[],
        recommendation=r.Recommendation(backend="", replicas=None, headline="", reasons=[], uncertainty=[]),
        notes=[*NOTES, *skipped],
    )
    runs = Runs(inputs.policy, traffic, config.seed, (workload.slo.ttft_ms, workload.slo.tpot_ms))
    report.sizing, _ = size(inputs, traffic, config, progress, runs)
    report.what_if = what_if(inputs, traffic, config, progress, runs)
    if inputs.fit is not None:
        report.notes.append(
            f"bench model-fit: the cost model's speedups were off by {inputs.fit.mape:.1f}% on average "
            "with the run's α, "
            f"{inputs.fit.mape_profile_alpha:.1f}% with the profile's α per category."
        )
    report.recommendation = recommend(report, profile, policy)
    return report
