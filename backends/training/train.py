"""`specroute train-drafter`: self-distil, extract features, train one drafter within a time
budget with held-out early stopping, measure it in real speculative runs, save weights + card."""

from __future__ import annotations

import hashlib
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from policies.drafters import DrafterConfig, TrainedKind, resolve, spec

from ..embedded import specroute_home
from ..errors import TrainingError
from ..generation import ChatMessage, GenerationRequest
from ..models import LoadedModel
from ..speculative.control import StepCosts
from ..speculative.engine import SpeculativeEngine, step_costs
from ..speculative.factory import build_drafter
from ..speculative.stats import SpeculationStats
from ..speculative.trained import DrafterCard, DraftVocab, HeldOut, save_drafter
from .data import Sample, data_dir, extract_features, generate_samples
from .loops import IGNORE, Metrics, Sequences, Task, autocast
from .prompts import CATEGORIES, TrainingPrompt, held_out_topic, training_prompts

WARMUP_STEPS = 20


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: TrainedKind
    minutes: float = Field(10.0, gt=0, le=24 * 60, description="training time budget (data and features excluded)")
    out: Path | None = Field(None, description="directory for <kind>.safetensors + <kind>.json")
    prompts: int | None = Field(None, ge=8, description="use only this many prompts (spread over categories)")
    max_new_tokens: int = Field(128, ge=8, le=1024, description="longest self-distilled answer")
    generate_batch: int = Field(64, ge=1, le=512)
    draft_vocab: int = Field(16384, ge=0, description="tokens a drafter may propose (most frequent answers); 0 = all")
    heads: int = Field(4, ge=1, le=8, description="Medusa heads")
    exit_layer: int = Field(8, ge=1, description="early exit: target layers under the adapter")
    eagle_width: int = Field(1536, ge=64, description="EAGLE decoder layer's MLP width")
    adapter_width: int = Field(512, ge=16, description="early-exit adapter's bottleneck width")
    lr: float = Field(1e-3, gt=0)
    batch_tokens: int = Field(4096, ge=64, description="EAGLE: padded tokens per training batch (whole sequences)")
    batch_positions: int = Field(
        512, ge=16, description="Medusa, early-exit: positions per training batch (each pays the LM head per head)"
    )
    noise: float = Field(0.1, ge=0, description="EAGLE: input feature noise, relative to the features' RMS")
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps even within the budget")
    eval_every: float = Field(45.0, gt=0, description="seconds of training between held-out evaluations")
    patience: int = Field(4, ge=1, description="evaluations without improvement before stopping")
    alpha_prompts: int = Field(6, ge=0, description="held-out prompts per category run speculatively for α")
    alpha_k: int = Field(4, ge=1, le=8, description="k of those runs")
    alpha_tokens: int = Field(64, ge=8, description="max_tokens of those runs")
    seed: int = 0
    data_root: Path | None = Field(None, description="self-distillation cache (default $SPECROUTE_HOME/drafter-data)")


def default_out(loaded: LoadedModel) -> Path:
    return specroute_home() / "drafters" / loaded.info.name.lower()


def pick_prompts(prompts: list[TrainingPrompt], limit: int | None, seed: int) -> list[TrainingPrompt]:
    """All prompts, or `limit` of them drawn evenly across categories and the held-out split."""
    if limit is None or limit >= len(prompts):
        return prompts
    rng = random.Random(seed)
    groups: dict[tuple[str, bool], list[TrainingPrompt]] = {}
    for p in prompts:
        groups.setdefault((p.category, held_out_topic(p.category, p.topic)), []).append(p)
    picked: list[TrainingPrompt] = []
    for key in sorted(groups):
        share = max(1, round(limit * len(groups[key]) / len(prompts)))
        picked += rng.sample(groups[key], min(share, len(groups[key])))
    return picked


def choose_draft_vocab(
    choices: Sequence[torch.Tensor], prompt_lengths: Sequence[int], size: int, vocab: int, always: Sequence[int]
) -> torch.Tensor:
    """The `size` tokens the target chose most often at answer positions of the training split
    (plus `always`, e.g. EOS); every token when `size` is 0 or covers the vocabulary."""
    if size == 0 or size >= vocab:
        return torch.arange(vocab)
    counts = Counter(t for c, p in zip(choices, prompt_lengths, strict=True) for t in c[p - 1 : -1].tolist())
    chosen = [t for t in always if t < vocab]
    chosen += [t for t, _ in counts.most_common() if t not in chosen][: size - len(chosen)]
    if len(chosen) < size:  # too little data to fill it: the rest by id, never a surprise gap in coverage
        taken = set(chosen)
        chosen += [t for t in range(vocab) if t not in taken][: size - len(chosen)]
    return torch.tensor(sorted(chosen))


def coverage(choices: Sequence[torch.Tensor], prompt_lengths: Sequence[int], ids: torch.Tensor) -> float:
    """Share of the target's answer-position choices that the draft vocabulary contains."""
    inside = torch.zeros(int(max(ids.max(), max(int(c.max()) for c in choices))) + 1, dtype=torch.bool)
    inside[ids] = True
    picked = torch.cat([c[p - 1 : -1] for c, p in zip(choices, prompt_lengths, strict=True)])
    return float(inside[picked].float().mean()) if len(picked) else 0.0


def task_class(kind: TrainedKind) -> type[Task]:
    """The kind's training task, as the registry names it."""
    task = spec(kind).task
    assert task is not None, f"the registry names no training task for {kind}"
    return resolve(task)


def cached_features(
    loaded: LoadedModel, samples: Sequence[Sample], layers: Sequence[int], folder: Path, progress: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Features at `layers` and the target's next-token choices for `samples`, each computed once
    per sample set: the choices come with the last layer's features; shallower layers run only
    the layers they need."""
    last = loaded.model.config.num_hidden_layers
    key = hashlib.sha256(repr([(s.id, len(s.ids)) for s in samples]).encode()).hexdigest()[:12]
    path = folder / f"features-{'-'.join(map(str, layers))}-{key}.pt"
    if list(layers) == [last]:
        if path.exists():
            return torch.load(path)
        result = extract_features(loaded, samples, layers, progress=progress)
    else:
        _, choices = cached_features(loaded, samples, [last], folder, progress)
        if path.exists():
            return torch.load(path), choices
        result = (extract_features(loaded, samples, layers, progress=progress, choices=False)[0], choices)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(result if list(layers) == [last] else result[0], path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return result


def to_sequences(
    samples: Sequence[Sample],
    features: Sequence[torch.Tensor],
    choices: Sequence[torch.Tensor],
    ids: torch.Tensor,
    vocab: int,
) -> Sequences:
    """labels[t] = draft-vocabulary index of the target's choice for position t (made after token
    t - 1), IGNORE at t = 0 and outside the draft vocabulary."""
    index = torch.full((vocab,), IGNORE, dtype=torch.long)
    index[ids] = torch.arange(len(ids))
    labels = [torch.cat([torch.full((1,), IGNORE), index[c[:-1]]]) for c in choices]
    seqs = [torch.tensor(s.ids) for s in samples]
    return Sequences(seqs, [len(s.prompt_ids) for s in samples], list(features), labels)


def fit(task: Task, train: Sequences, held: Sequences, config: TrainConfig, progress: bool) -> dict[str, object]:
    """AdamW with warm-up and a linear decay over the time budget; evaluates every `eval_every`
    seconds, keeps the best held-out state, stops early after `patience` evaluations without
    improvement."""
    net = task.net
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    budget = config.minutes * 60
    rng = random.Random(config.seed)
    size = config.batch_tokens if task.sequence_level else config.batch_positions
    best = task.evaluate(held, size)
    untrained = best
    best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    history = [_point(0, 0.0, best)]
    started = last_eval = time.perf_counter()
    steps, epochs, stale, best_step = 0, 0, 0, 0
    warmup = min(WARMUP_STEPS, max(1, (config.max_steps or WARMUP_STEPS * 5) // 5))
    bar = tqdm(total=int(budget), desc=f"training {type(net).__name__}", unit="s", disable=not progress)
    net.train()
    done = False
    while not done:
        epochs += 1
        for batch in task.batches(train, size, rng):
            elapsed = time.perf_counter() - started
            for group in optimizer.param_groups:
                group["lr"] = config.lr * min(1.0, (steps + 1) / warmup) * max(0.05, 1 - elapsed / budget)
            with autocast():
                loss, _ = task.loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            steps += 1
            now = time.perf_counter()
            bar.n = min(int(now - started), int(budget))
            bar.set_postfix(loss=f"{loss.item():.3f}", held_top1=f"{best.top1[0]:.3f}")
            out_of_steps = config.max_steps is not None and steps >= config.max_steps
            if now - last_eval >= config.eval_every or now - started >= budget or out_of_steps:
                last_eval = now
                metrics = task.evaluate(held, size)
                history.append(_point(steps, now - started, metrics))
                if metrics.top1[0] > best.top1[0]:
                    best, best_step, stale = metrics, steps, 0
                    best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
                else:
                    stale += 1
                if stale >= config.patience or now - started >= budget or out_of_steps:
                    done = True
                    break
    bar.close()
    net.load_state_dict(best_state)
    net.eval()
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "steps": steps,
        "epochs": epochs,
        "best_step": best_step,
        "stopped_early": stale >= config.patience,
        "held_out_loss": round(best.loss, 4),
        "history": history,
        "untrained": untrained,
        "best": best,
    }


def _point(step: int, seconds: float, m: Metrics) -> dict[str, object]:
    return {"step": step, "seconds": round(seconds, 1), "loss": round(m.loss, 4), "top1": [round(t, 4) for t in m.top1]}


def held_out_alpha(
    loaded: LoadedModel,
    path: Path,
    kind: TrainedKind,
    held: Sequence[Sample],
    prompts: dict[str, TrainingPrompt],
    config: TrainConfig,
    costs: StepCosts | None = None,
) -> dict[str, float]:
    """α per category of real greedy speculative runs (fixed k) with the saved drafter, loaded the
    way users load it, on held-out prompts: accepted drafts / judged drafts. Every category's
    prompts run in one batch (greedy tokens do not depend on the batch) and each row's own counts
    are added up by category. `costs`: the target's step-cost table, where one is at hand."""
    chosen = [
        sample
        for category in CATEGORIES
        for sample in [s for s in held if s.category == category][: config.alpha_prompts]
    ]
    if not chosen:
        return {}
    drafter = build_drafter(DrafterConfig(kind=kind, weights=str(path)), loaded)
    if costs is None or costs.max_width <= config.alpha_k:
        costs = step_costs(loaded, max_width=config.alpha_k + 1)
    engine = SpeculativeEngine(loaded, drafter, k=config.alpha_k, costs=costs)
    requests = [
        GenerationRequest(messages=[ChatMessage(**m) for m in prompts[s.id].messages()], max_tokens=config.alpha_tokens)
        for s in chosen
    ]
    rows: dict[str, list[SpeculationStats]] = {}
    for sample, result in zip(chosen, engine.generate(requests), strict=True):
        if result.speculation is not None:
            rows.setdefault(sample.category, []).append(result.speculation)
    return {category: round(SpeculationStats.combined(stats).alpha, 4) for category, stats in rows.items()}


def train_drafter(
    config: TrainConfig,
    loaded: LoadedModel,
    progress: bool = True,
    log: Callable[[str], None] = print,
    costs: StepCosts | None = None,
) -> tuple[Path, DrafterCard]:
    """`costs`: the target's step-cost table for the held-out α runs, where one is at hand (else
    they probe their own)."""
    kind, task_type = config.kind, task_class(config.kind)
    layers = task_type.feature_layers(config, loaded.model.config.num_hidden_layers)  # refuse bad settings first
    torch.manual_seed(config.seed)
    prompts = pick_prompts(training_prompts(config.seed), config.prompts, config.seed)
    by_id = {p.id: p for p in prompts}
    folder = data_dir(loaded, config.data_root)
    samples = generate_samples(
        loaded,
        prompts,
        folder / f"samples-{config.max_new_tokens}.jsonl",
        config.max_new_tokens,
        config.generate_batch,
        progress,
    )
    train = [s for s in samples if not held_out_topic(s.category, s.topic)]
    held = [s for s in samples if held_out_topic(s.category, s.topic)]
    if not train or not held:
        raise TrainingError("too few prompts: both the training and the held-out topics need some (raise --prompts)")
    model = loaded.model
    vocab = model.config.vocab_size
    eos = [t for t in [loaded.tokenizer.eos_token_id] if t is not None]
    feats, choices = cached_features(loaded, train + held, layers, folder, progress)
    n = len(train)
    lengths = [len(s.prompt_ids) for s in train + held]
    draft_ids = choose_draft_vocab(choices[:n], lengths[:n], config.draft_vocab, vocab, eos)
    train_seqs = to_sequences(train, feats[:n], choices[:n], draft_ids, vocab)
    held_seqs = to_sequences(held, feats[n:], choices[n:], draft_ids, vocab)
    rms = float(torch.cat([f.float() for f in feats[:64]]).pow(2).mean().sqrt())
    head = DraftVocab(model.get_output_embeddings().weight, draft_ids, torch.float32)
    model.requires_grad_(False)
    task = task_type.create(config, loaded, head, rms)
    log(
        f"{config.kind}: {len(train)} training / {len(held)} held-out sequences, "
        f"{sum(len(s.response_ids) for s in train)} / {sum(len(s.response_ids) for s in held)} answer tokens, "
        f"draft vocabulary {len(draft_ids)}, {sum(p.numel() for p in task.net.parameters()):,} parameters"
    )
    result = fit(task, train_seqs, held_seqs, config, progress)
    best, untrained = result.pop("best"), result.pop("untrained")
    assert isinstance(best, Metrics) and isinstance(untrained, Metrics)
    out = (config.out or default_out(loaded)) / f"{kind}.safetensors"
    card = DrafterCard(
        kind=kind,
        target=loaded.info.name,
        fingerprint=loaded.fingerprint,
        vocab_size=vocab,
        hidden_size=model.config.hidden_size,
        draft_vocab_size=len(draft_ids),
        layers=layers,
        **task_type.card_fields(config),
        parameters=sum(p.numel() for p in task.net.parameters()),
        held_out=HeldOut(
            top1_by_position=[round(t, 4) for t in best.top1],
            coverage=round(coverage(choices[n:], lengths[n:], draft_ids), 4),
            untrained_top1=round(untrained.top1[0], 4),
        ),
        data=_data_summary(train, held, config),
        training={
            **result,
            "lr": config.lr,
            "batch": config.batch_tokens if task.sequence_level else config.batch_positions,
            "budget_minutes": config.minutes,
            "threads": torch.get_num_threads(),
            "noise": config.noise if task.noise else 0.0,
        },
        command=" ".join(shlex.quote(a) for a in ["specroute", *sys.argv[1:]]) if sys.argv[1:] else "",
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    save_drafter(out, card, task.net, draft_ids)
    log(f"measuring α on held-out prompts (k = {config.alpha_k}) …")
    alpha = held_out_alpha(loaded, out, kind, held, by_id, config, costs)
    card.held_out.alpha_by_category, card.held_out.alpha_k = alpha, config.alpha_k
    save_drafter(out, card, task.net, draft_ids)
    return out, card


def _data_summary(train: Sequence[Sample], held: Sequence[Sample], config: TrainConfig) -> dict[str, object]:
    def part(samples: Sequence[Sample]) -> dict[str, object]:
        return {
            "sequences": len(samples),
            "answer_tokens": sum(len(s.response_ids) for s in samples),
            "topics": len({(s.category, s.topic) for s in samples}),
            "by_category": dict(Counter(s.category for s in samples)),
        }

    return {
        "train": part(train),
        "held_out": part(held),
        "max_new_tokens": config.max_new_tokens,
        "labels": "the target's own greedy tokens, generated in the dtype it serves in",
    }


def render_card(card: DrafterCard) -> str:
    """The card as a few readable lines."""
    h, t, d = card.held_out, card.training, card.data
    positions = " ".join(f"{p:.3f}" for p in h.top1_by_position)
    lines = [
        f"{card.kind} drafter for {card.target} ({card.parameters:,} trained parameters, "
        f"draft vocabulary {card.draft_vocab_size:,} of {card.vocab_size:,})",
        f"  data: {d['train']['sequences']} training sequences ({d['train']['answer_tokens']:,} answer tokens), "
        f"{d['held_out']['sequences']} held-out ({d['held_out']['answer_tokens']:,}), split by topic",
        f"  training: {t['seconds']:.0f} s, {t['steps']} steps, {t['epochs']} epochs, best at step {t['best_step']}"
        + (" (stopped early)" if t.get("stopped_early") else ""),
        f"  held-out top-1 by draft position: {positions} (untrained: {h.untrained_top1:.3f})",
        f"  draft-vocabulary coverage of held-out target tokens: {h.coverage:.1%}",
    ]
    if h.alpha_by_category:
        alphas = ", ".join(f"{c} {a:.2f}" for c, a in h.alpha_by_category.items())
        lines.append(f"  held-out α at k = {h.alpha_k} (greedy speculative runs): {alphas}")
    return "\n".join(lines)
