"""The speculative decoding loop: draft k → one target pass over the pending token and the k
drafts → exact accept/reject → roll both caches back past the accepted prefix → emit n + 1.

Rows of a batch accept different counts; `BatchedCache` keeps per-row lengths and positions, and
every row samples from its own generator, so a row's output never depends on its batch-mates.
Tokens are emitted one at a time through `SequenceState`, so EOS, stop strings and max_tokens
landing inside an accepted block end the sequence right there. k = 0 is a plain step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from transformers import PreTrainedModel

from ..errors import RequestError
from ..generation import GenerationRequest, GenerationResult, SequenceState
from ..models import LoadedModel
from ..plain import PlainEngine
from ..sampling import new_generator, sample_tokens, target_probs
from .control import AcceptanceTracker, KChooser, StepCosts
from .drafters import Drafter, DraftRow, Proposal
from .kv import BatchedCache
from .rejection import accept_greedy, accept_sampled
from .stats import SpeculationStats

KSetting = int | Literal["auto"]
PROBE_CONTEXT = 64  # tokens per row in the step-cost probe
PROBE_REPEATS = 3


@dataclass
class _Row:
    state: SequenceState
    draft: DraftRow
    stats: SpeculationStats
    chooser: KChooser | None


@dataclass
class _Run:
    """One `generate` call: its rows, which are still running, the target's cache."""

    rows: list[_Row]
    active: list[int]
    target: BatchedCache
    drafter_started: bool = False


class SpeculativeEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        drafter: Drafter,
        k: KSetting = "auto",
        k_max: int = 8,
        costs: StepCosts | None = None,
    ):
        """`costs` may be shared by engines serving the same target, so its step times are probed once."""
        if k != "auto" and not (isinstance(k, int) and k >= 0):
            raise RequestError(f"k must be a non-negative integer or 'auto' (got {k!r})")
        if not 1 <= k_max <= 32:
            raise RequestError(f"k_max must be between 1 and 32 (got {k_max})")
        self.plain = PlainEngine(loaded)  # prompt encoding, EOS ids and context checks are shared
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.drafter, self.k = drafter, k
        self.k_max = k_max if k == "auto" else k
        self.costs = costs or step_costs(loaded, max_width=self.k_max + 1)
        self.totals = SpeculationStats(drafter=drafter.name, k_mode=str(k))
        self.acceptance = AcceptanceTracker(decay=0.99)  # this drafter's acceptance across requests
        BatchedCache(self.model, self.tokenizer.pad_token_id)  # refuses models whose cache cannot roll back

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        self.costs.seconds(len(requests), 1)  # probes step costs once per batch size, before the clock starts
        rows = self._start(requests)
        run = _Run(rows, list(range(len(rows))), BatchedCache(self.model, self.tokenizer.pad_token_id))
        logits = run.target.prefill([r.state.prompt_ids for r in rows])
        first = sample_tokens(logits, [r.draft.sampling for r in rows], [r.draft.generator for r in rows])
        self._finish_rows(run, self._emit(run, [[int(t)] for t in first.tolist()]))
        while run.active:
            self._step(run)
        return [r.state.result(self.tokenizer).model_copy(update={"speculation": r.stats}) for r in rows]

    def _step(self, run: _Run) -> None:
        rows, active, batch = run.rows, run.active, len(run.active)
        ks = [self._choose_k(rows[i], batch) for i in active]
        started = time.perf_counter()
        proposal = self._propose(run, ks)
        drafted_at = time.perf_counter()
        drafts = [tokens[:k] for tokens, k in zip(proposal.tokens, ks, strict=True)]
        width = self.costs.cheapest_width(batch, 1 + max(len(d) for d in drafts))
        before = run.target.lengths.clone()
        blocks = [[rows[i].state.token_ids[-1], *d] for i, d in zip(active, drafts, strict=True)]
        logits = run.target.extend(blocks, width)
        accepted, next_tokens = self._verify(rows, active, drafts, proposal.q, logits)
        run.target.truncate(before + 1 + accepted)
        verified_at = time.perf_counter()
        if run.drafter_started:
            self.drafter.observe(accepted.tolist())
        self._record(run, ks, drafts, accepted.tolist(), (drafted_at - started, verified_at - drafted_at, width))
        emitted = [d[:n] + [int(t)] for d, n, t in zip(drafts, accepted.tolist(), next_tokens.tolist(), strict=True)]
        self._finish_rows(run, self._emit(run, emitted))

    def _propose(self, run: _Run, ks: list[int]) -> Proposal:
        """Ask the drafter; it starts (prefills its own state) only once some row wants drafts."""
        if not any(ks):
            return Proposal([[] for _ in ks])
        drafts = [run.rows[i].draft for i in run.active]
        if not run.drafter_started:
            self.drafter.start(drafts)
            run.drafter_started = True
        return self.drafter.propose(drafts, ks)

    def _verify(
        self, rows: list[_Row], active: list[int], drafts: list[list[int]], q: torch.Tensor | None, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accepted count and next token per row: greedy rows by argmax, sampling rows exactly."""
        width = max(len(d) for d in drafts)
        padded = torch.zeros((len(drafts), width), dtype=torch.long, device=logits.device)
        for b, d in enumerate(drafts):
            padded[b, : len(d)] = torch.tensor(d, dtype=torch.long)
        lengths = torch.tensor([len(d) for d in drafts], device=logits.device)
        logits = logits[:, : width + 1]
        accepted, next_tokens = accept_greedy(padded, lengths, logits.argmax(dim=-1))
        sampled = [b for b, i in enumerate(active) if not rows[i].draft.sampling.greedy]
        if sampled:
            params = [rows[active[b]].draft.sampling for b in sampled]
            p = target_probs(logits[sampled], params)
            q_rows = None if q is None else q[sampled, :width]
            gens = [rows[active[b]].draft.generator for b in sampled]
            accepted[sampled], next_tokens[sampled] = accept_sampled(padded[sampled], lengths[sampled], p, q_rows, gens)
        return accepted, next_tokens

    def _emit(self, run: _Run, emitted: list[list[int]]) -> list[int]:
        """Append each row's tokens one by one, stopping where the row finishes; the batch
        positions of rows still running."""
        return [
            b
            for b, (i, tokens) in enumerate(zip(run.active, emitted, strict=True))
            if not any(run.rows[i].state.append(t, self.tokenizer) for t in tokens)
        ]

    def _finish_rows(self, run: _Run, keep: list[int]) -> None:
        """Finished rows leave the target's cache and the drafter's state."""
        if keep and len(keep) < len(run.active):
            run.target.select(keep)
            if run.drafter_started:
                self.drafter.select(keep)
        run.active = [run.active[b] for b in keep]

    def _choose_k(self, row: _Row, batch: int) -> int:
        state = row.state
        k = row.chooser.choose(self.costs, batch) if row.chooser else int(self.k)
        left = state.request.max_tokens - len(state.token_ids)
        room = (self.plain.context_length or 1 << 30) - row.draft.length
        # A step emits up to k + 1 tokens: never draft past max_tokens or the context.
        return max(0, min(k, left - 1, room - 1))

    def _record(
        self, run: _Run, ks: list[int], drafts: list[list[int]], accepted: list[int], times: tuple[float, float, int]
    ) -> None:
        draft_s, verify_s, width = times
        batch, drafted = len(run.active), [len(d) for d in drafts]
        self.costs.record_draft(batch, sum(drafted), draft_s)
        self.costs.record_target(batch, width, verify_s)
        step_s = self.costs.seconds(batch, 1)
        for i, k, d, n in zip(run.active, ks, drafted, accepted, strict=True):
            row = run.rows[i]
            row.stats.target_step_s = step_s
            row.stats.record(k, [d], [n], draft_s, verify_s)
            self.acceptance.update(d, n)
            if row.chooser:
                row.chooser.observe(d, n)
        self.totals.target_step_s = step_s
        self.totals.record(max(ks), drafted, accepted, draft_s, verify_s)

    def _start(self, requests: Sequence[GenerationRequest]) -> list[_Row]:
        rows = []
        now = time.perf_counter()
        for request in requests:
            generator, seed = new_generator(request.sampling.seed)
            state = SequenceState(request, self.plain.encode(request), self.plain.eos_ids, seed, now)
            draft = DraftRow(state.prompt_ids, state.token_ids, request.sampling, generator)
            chooser = None
            if self.k == "auto":
                # A new request starts from what this drafter achieved on earlier ones.
                # Weight 4: a drafter known to fail rarely tempts a request into a costly first draft.
                tracker = AcceptanceTracker(prior_alpha=self.acceptance.alpha, prior_weight=4.0)
                chooser = KChooser(self.k_max, tracker, np.random.default_rng(seed))
            stats = SpeculationStats(drafter=self.drafter.name, k_mode=str(self.k))
            rows.append(_Row(state, draft, stats, chooser))
        return rows


def step_costs(loaded: LoadedModel, max_width: int) -> StepCosts:
    """A step-cost table for this target, probed lazily per batch size."""

    def probe(batch: int, widths: Sequence[int]) -> dict[int, float]:
        return measure_step_times(loaded.model, loaded.tokenizer.pad_token_id, batch, widths)

    return StepCosts(probe, max_width=max_width)


@torch.inference_mode()
def measure_step_times(model: PreTrainedModel, pad_id: int, batch: int, widths: Sequence[int]) -> dict[int, float]:
    """Best-of-3 seconds of a target pass of each width (new tokens per row) over a short random context."""
    cache = BatchedCache(model, pad_id)
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    cache.prefill(torch.randint(0, vocab, (batch, PROBE_CONTEXT), generator=generator).tolist())
    lengths = cache.lengths.clone()
    seconds = {}
    for width in widths:
        best = float("inf")
        for _ in range(PROBE_REPEATS):
            block = torch.randint(0, vocab, (batch, width), generator=generator).tolist()
            started = time.perf_counter()
            cache.extend(block)
            best = min(best, time.perf_counter() - started)
            cache.truncate(lengths)
        seconds[width] = best
    return seconds
