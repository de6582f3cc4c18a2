"""The speculative engine: the step loop with one drafter — draft k → one target pass over the
pending token and the k drafts → exact accept/reject → cut both caches back past the accepted
prefix → emit n + 1. The loop itself lives in `backends.scheduler`; this is the one-drafter view
of it that tests, benchmarks, the profiler and `specroute generate` use.

Rows of a batch accept different counts; the paged cache keeps per-row lengths and positions,
and every row samples from its own generator, so a row's output never depends on its batch-mates.
Tokens are emitted one at a time through `SequenceState`, so EOS, stop strings and max_tokens
landing inside an accepted block end the sequence right there. k = 0 is a plain step.

A seed reproduces a sample exactly with a fixed k. With k = auto the distribution is still the
target's, but k follows measured timings, and k decides how many random numbers a step draws.
"""

from __future__ import annotations

from policies.profile import AcceptanceMap

from ..models import LoadedModel
from ..scheduler import K_LIMIT, KSetting, LoopSettings, Scheduler, measure_step_times, step_costs
from .control import DraftCosts, StepCosts
from .drafters import Drafter
from .stats import SpeculationStats

__all__ = ["K_LIMIT", "KSetting", "SpeculativeEngine", "measure_step_times", "step_costs"]


class SpeculativeEngine(Scheduler):
    def __init__(
        self,
        loaded: LoadedModel,
        drafter: Drafter,
        k: KSetting = "auto",
        k_max: int = 8,
        costs: StepCosts | None = None,
        settings: LoopSettings | None = None,
        acceptance: AcceptanceMap | None = None,
    ):
        """`costs` (the target's step-time table) may be shared by engines serving the same target;
        `acceptance`: the drafter's fitted acceptance map to start from."""
        maps = {drafter.name: acceptance} if acceptance is not None else None
        super().__init__(loaded, settings, [drafter], k, k_max, costs, acceptance_maps=maps)
        self.drafter = drafter

    @property
    def totals(self) -> SpeculationStats:
        """This drafter's statistics over every request the engine ran."""
        return self.drafter_totals[self.drafter.name]

    def acceptance_map(self) -> AcceptanceMap:
        """This drafter's per-proposal acceptance map fitted on every position the engine judged
        (scored out of fold, requests held out)."""
        return self.predictors[self.drafter.name].fitted()

    @property
    def draft_costs(self) -> DraftCosts:
        """This drafter's measured seconds per draft step, by batch bucket."""
        return self.drafter_costs[self.drafter.name]
