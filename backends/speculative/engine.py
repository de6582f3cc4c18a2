"""The speculative decoding loop: draft k → one target pass over the pending token and the k
drafts → exact accept/reject → roll both caches back past the accepted prefix → emit n + 1.

Rows of a batch accept different counts; `BatchedCache` keeps per-row lengths and positions, and
every row samples from its own generator, so a row's output never depends on its batch-mates.
Tokens are emitted one at a time through `SequenceState`, so EOS, stop strings and max_tokens
landing inside an accepted block end the sequence right there. k = 0 is a plain step.

A seed reproduces a sample exactly with a fixed k. With k = auto the distribution is still the
target's, but k follows measured timings, and k decides how many random numbers a step draws.

One engine runs one `generate` call at a time (the drafter keeps per-batch state).
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
from ..generation import GenerationRequest, GenerationResult, SequenceState, TokenListener, listener_for
from ..models import LoadedModel
from ..plain import PlainEngine
from ..sampling import new_generator, sample_tokens, target_probs
from .control import AcceptanceTracker, DraftCosts, KChooser, StepCosts
from .drafters import Drafter, DraftRow, Proposal
from .kv import BatchedCache
from .rejection import accept_greedy, accept_sampled
from .stats import SpeculationStats

KSetting = int | Literal["auto"]
K_LIMIT = 32
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
    drafted_last_step: bool = False


@dataclass
class _Step:
    """What one speculative step did, for the statistics and the cost tables."""

    ks: list[int]
    drafts: list[list[int]]
    accepted: list[int]
    draft_s: float
    verify_s: float
    forward_s: float
    width: int
    steady: bool  # the drafter also drafted the step before, so no catch-up is in draft_s


class SpeculativeEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        drafter: Drafter,
        k: KSetting = "auto",
        k_max: int = 8,
        costs: StepCosts | None = None,
    ):
        """`costs` (the target's step-time table) may be shared by engines serving the same target."""
        if k != "auto" and not (type(k) is int and 0 <= k <= K_LIMIT):
            raise RequestError(f"k must be an integer from 0 to {K_LIMIT} or 'auto' (got {k!r})")
        if k == "auto" and not 1 <= k_max <= K_LIMIT:
            raise RequestError(f"k_max must be between 1 and {K_LIMIT} (got {k_max})")
        self.plain = PlainEngine(loaded)  # prompt encoding, EOS ids and context checks are shared
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.drafter, self.k = drafter, k
        self.k_max = k_max if k == "auto" else k
        self.costs = costs or step_costs(loaded, max_width=self.k_max + 1)
        if self.costs.max_width < self.k_max + 1:
            raise ValueError(
                f"the shared step-cost table covers widths up to {self.costs.max_width}, need {self.k_max + 1}"
            )
        self.draft_costs = DraftCosts()
        self.totals = SpeculationStats(drafter=drafter.name, k_mode=str(k))
        self.acceptance = AcceptanceTracker(decay=0.99)  # this drafter's acceptance across requests
        BatchedCache(self.model, self.tokenizer.pad_token_id)  # refuses models whose cache cannot roll back

    @torch.inference_mode()
    def generate(
        self, requests: Sequence[GenerationRequest], listeners: Sequence[TokenListener | None] | None = None
    ) -> list[GenerationResult]:
        """Decode a batch to completion; `listeners[i]` (optional) hears request i's tokens as they come."""
        if not requests:
            return []
        self.costs.ensure(len(requests))  # step-cost probes run before any request's clock starts
        rows = self._start(requests, listeners)
        target = BatchedCache(self.model, self.tokenizer.pad_token_id, self.drafter.feature_layers)
        run = _Run(rows, list(range(len(rows))), target)
        logits = run.target.prefill([r.state.prompt_ids for r in rows])
        if self.drafter.feature_layers:  # a feature drafter reads the prompt's hidden states now
            self.drafter.start([r.draft for r in rows])
            run.drafter_started = True
            self._report_features(run, [(-len(r.state.prompt_ids), None) for r in rows])
        first = sample_tokens(logits, [r.draft.sampling for r in rows], [r.draft.generator for r in rows])
        self._finish_rows(run, self._emit(run, [[int(t)] for t in first.tolist()]))
        while run.active:
            self._step(run)
        return [r.state.result(self.tokenizer) for r in rows]

    def _step(self, run: _Run) -> None:
        rows, active, batch = run.rows, run.active, len(run.active)
        ks = [self._choose_k(rows[i], batch) for i in active]
        steady = run.drafted_last_step
        started = time.perf_counter()
        proposal = self._propose(run, ks)
        drafted_at = time.perf_counter()
        drafts = [tokens[:k] for tokens, k in zip(proposal.tokens, ks, strict=True)]
        width = self.costs.cheapest_width(batch, 1 + max(len(d) for d in drafts))
        before = run.target.lengths.clone()
        blocks = [[rows[i].state.token_ids[-1], *d] for i, d in zip(active, drafts, strict=True)]
        logits = run.target.extend(blocks, width)
        if logits.is_cuda:  # kernels run asynchronously: wait for them before reading the clock
            torch.cuda.synchronize(logits.device)
        forward_s = time.perf_counter() - drafted_at
        accepted, next_tokens = self._verify(rows, active, drafts, proposal.q, logits)
        run.target.truncate(before + 1 + accepted)
        verified_at = time.perf_counter()
        counts = accepted.tolist()
        if any(ks):
            self.drafter.observe(counts)
        if self.drafter.feature_layers:  # the pending token and the accepted drafts were verified
            self._report_features(run, [(0, n + 1) for n in counts])
        run.drafted_last_step = any(ks)
        step = _Step(ks, drafts, counts, drafted_at - started, verified_at - drafted_at, forward_s, width, steady)
        self._record(run, step)
        emitted = [d[:n] + [int(t)] for d, n, t in zip(drafts, counts, next_tokens.tolist(), strict=True)]
        self._finish_rows(run, self._emit(run, emitted))

    def _report_features(self, run: _Run, spans: list[tuple[int, int | None]]) -> None:
        """Hand the drafter each row's slice [start:stop] of the last target pass's features."""
        features = run.target.features
        assert features is not None
        self.drafter.observe_target([features[b, start:stop] for b, (start, stop) in enumerate(spans)])

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
        draft_width = max(len(d) for d in drafts)
        padded = torch.zeros((len(drafts), draft_width), dtype=torch.long, device=logits.device)
        for b, d in enumerate(drafts):
            padded[b, : len(d)] = torch.tensor(d, dtype=torch.long)
        lengths = torch.tensor([len(d) for d in drafts], device=logits.device)
        logits = logits[:, : draft_width + 1]
        accepted, next_tokens = accept_greedy(padded, lengths, logits.argmax(dim=-1))
        sampled = [b for b, i in enumerate(active) if not rows[i].draft.sampling.greedy]
        if sampled:
            params = [rows[active[b]].draft.sampling for b in sampled]
            p = target_probs(logits[sampled], params)
            q_rows = None if q is None else q[sampled, :draft_width]
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
        if row.chooser:
            c = self.draft_costs.relative(batch, self.costs)
            k = row.chooser.choose(c, self.costs.verify_costs(batch))
        else:
            k = int(self.k)
        if self.drafter.max_draft is not None:
            k = min(k, self.drafter.max_draft)
        left = state.request.max_tokens - len(state.token_ids)
        room = (self.plain.context_length or 1 << 30) - row.draft.length
        # A step emits up to k + 1 tokens: never draft past max_tokens or the context.
        return max(0, min(k, left - 1, room - 1))

    def _record(self, run: _Run, step: _Step) -> None:
        batch, drafted = len(run.active), [len(d) for d in step.drafts]
        if step.steady:  # a first draft after plain steps also pays the drafter's start-up and catch-up
            self.draft_costs.record(batch, max(drafted), step.draft_s)
        self.costs.record_target(batch, step.width, step.forward_s)
        step_s = self.costs.seconds(batch, 1)
        for i, k, d, n in zip(run.active, step.ks, drafted, step.accepted, strict=True):
            row = run.rows[i]
            row.stats.target_step_s = step_s
            # A row pays drafting time only on steps it drafted in.
            row.stats.record(k, [d], [n], step.draft_s if d else 0.0, step.verify_s)
            self.acceptance.update(d, n)
            if row.chooser:
                row.chooser.observe(d, n)
        self.totals.target_step_s = step_s
        self.totals.record(max(step.ks), drafted, step.accepted, step.draft_s, step.verify_s, step.ks)

    def _start(
        self, requests: Sequence[GenerationRequest], listeners: Sequence[TokenListener | None] | None
    ) -> list[_Row]:
        rows = []
        now = time.perf_counter()
        for i, request in enumerate(requests):
            generator, seed = new_generator(request.sampling.seed)
            listener = listener_for(listeners, i, len(requests))
            state = SequenceState(request, self.plain.encode(request), self.plain.eos_ids, seed, now, listener=listener)
            draft = DraftRow(state.prompt_ids, state.token_ids, request.sampling, generator)
            chooser = None
            if self.k == "auto":
                # A new request starts from what this drafter achieved on earlier ones.
                # Weight 4: a drafter known to fail rarely tempts a request into a costly first draft.
                tracker = AcceptanceTracker(prior_alpha=self.acceptance.alpha, prior_weight=4.0)
                chooser = KChooser(self.k_max, tracker, np.random.default_rng(seed))
            stats = SpeculationStats(drafter=self.drafter.name, k_mode=str(self.k))
            state.speculation = stats  # a row's result carries its statistics, even read mid-batch
            rows.append(_Row(state, draft, stats, chooser))
        return rows


def step_costs(loaded: LoadedModel, max_width: int) -> StepCosts:
    """A step-cost table for this target, probed per batch bucket on first use."""

    def probe(batch: int, widths: Sequence[int]) -> dict[int, float]:
        return measure_step_times(loaded.model, loaded.tokenizer.pad_token_id, batch, widths)

    return StepCosts(probe, max_width=max_width)


@torch.inference_mode()
def measure_step_times(
    model: PreTrainedModel,
    pad_id: int,
    batch: int,
    widths: Sequence[int],
    context: int = PROBE_CONTEXT,
    repeats: int = PROBE_REPEATS,
) -> dict[int, float]:
    """Best-of-`repeats` seconds of a target pass of each width (new tokens per row) over a random
    context. The repeats go round all widths in turn, so a slow spell on a busy machine spoils
    one round of every width rather than every try of one width."""
    cache = BatchedCache(model, pad_id)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size  # not the LM head: an int8 head has no float weight matrix
    cache.prefill(torch.randint(0, vocab, (batch, context), generator=generator).tolist())
    lengths = cache.lengths.clone()
    # One untimed pass first: a dtype's first kernels can carry one-off set-up costs (bf16 on CPU).
    float(cache.extend(torch.randint(0, vocab, (batch, 1), generator=generator).tolist())[0, -1, 0])
    cache.truncate(lengths)
    seconds = dict.fromkeys(widths, float("inf"))
    for _ in range(repeats):
        for width in widths:
            block = torch.randint(0, vocab, (batch, width), generator=generator).tolist()
            started = time.perf_counter()
            float(cache.extend(block)[0, -1, 0])  # reading a value waits for an asynchronous device
            seconds[width] = min(seconds[width], time.perf_counter() - started)
            cache.truncate(lengths)
    return seconds
