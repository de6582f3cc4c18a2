"""Self-distillation data: the target answers the training prompts itself (greedy, in the dtype
it serves in, large batches), then one teacher-forced pass over prompt + answer records the
hidden states drafters learn from. Both stages are cached under $SPECROUTE_HOME and resume
where they stopped; the cache is keyed by the target's fingerprint, so another target never
reuses it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..embedded import specroute_home
from ..generation import ChatMessage, GenerationRequest
from ..kv import capture_hidden_states
from ..models import LoadedModel
from ..plain import PlainEngine, left_pad, position_ids
from ..speculative.drafters import early_exit_model
from .prompts import TrainingPrompt


@dataclass
class Sample:
    """One self-distilled sequence: the chat-rendered prompt and the target's greedy answer."""

    id: str
    category: str
    topic: str
    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def data_dir(loaded: LoadedModel, root: Path | None = None) -> Path:
    base = root or specroute_home() / "drafter-data"
    return base / f"{loaded.fingerprint[:16]}-{loaded.info.dtype}"


def load_samples(path: Path) -> list[Sample]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [Sample(**json.loads(line)) for line in f if line.strip()]


def generate_samples(
    loaded: LoadedModel,
    prompts: Sequence[TrainingPrompt],
    path: Path,
    max_new_tokens: int = 128,
    batch: int = 64,
    progress: bool = True,
) -> list[Sample]:
    """The target's greedy answers to `prompts`, appended to `path` one batch at a time; prompts
    already answered there are skipped, so an interrupted run resumes."""
    done = {s.id: s for s in load_samples(path)}
    todo = [p for p in prompts if p.id not in done]
    engine = PlainEngine(loaded)
    requests = {p.id: _request(p, max_new_tokens) for p in todo}
    lengths = {p.id: len(engine.encode(requests[p.id])) for p in todo}
    todo.sort(key=lambda p: lengths[p.id])  # similar lengths share a batch: less padding
    path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(
        total=len(prompts),
        initial=len(prompts) - len(todo),
        desc="self-distilling",
        unit="prompt",
        disable=not progress,
    )
    with path.open("a", encoding="utf-8") as out:
        for start in range(0, len(todo), batch):
            group = todo[start : start + batch]
            results = engine.generate([requests[p.id] for p in group])
            for prompt, result in zip(group, results, strict=True):
                sample = Sample(
                    prompt.id, prompt.category, prompt.topic, engine.encode(requests[prompt.id]), result.token_ids
                )
                done[prompt.id] = sample
                out.write(json.dumps(sample.__dict__) + "\n")
            out.flush()
            bar.update(len(group))
    bar.close()
    return [done[p.id] for p in prompts]


def _request(prompt: TrainingPrompt, max_new_tokens: int) -> GenerationRequest:
    messages = [ChatMessage(**m) for m in prompt.messages()]
    return GenerationRequest(messages=messages, max_tokens=max_new_tokens)


@torch.inference_mode()
def extract_features(
    loaded: LoadedModel,
    samples: Sequence[Sample],
    layers: Sequence[int],
    batch_tokens: int = 8192,
    progress: bool = True,
    choices: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sample, the target's hidden states at `layers` (transformers' `hidden_states`
    indices: 0 the embeddings, i the output of layer i - 1, the last one after the final norm, so
    the LM head of it gives the logits) for every position of prompt + answer, concatenated over
    layers: (T, len(layers) · H), bfloat16; and, with `choices`, the target's own next-token
    choice after every position, (T,): the labels. Without `choices` only the first max(layers)
    layers run."""
    model, pad = loaded.model, loaded.tokenizer.pad_token_id
    last = model.config.num_hidden_layers
    depth = last if choices else max(layers)
    runner = model if depth == last else early_exit_model(model, depth)  # shares the target's layers
    wanted = sorted({*layers, *([last] if choices else [])})
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))
    features: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    labels: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    head = model.get_output_embeddings()
    bar = tqdm(total=len(samples), desc="target features", unit="seq", disable=not progress)
    for group in _length_groups(samples, order, batch_tokens):
        input_ids, mask = left_pad([samples[i].ids for i in group], pad, model.device)
        captured = _run_capturing(model, runner, wanted, input_ids, mask)
        stacked = torch.cat([captured[layer] for layer in layers], dim=-1)
        picked = head(captured[last]).argmax(dim=-1) if choices else None
        for row, i in enumerate(group):
            n = len(samples[i].ids)
            features[i] = stacked[row, -n:].to(torch.bfloat16).clone()
            if picked is not None:
                labels[i] = picked[row, -n:].clone()
        bar.update(len(group))
    bar.close()
    return features, labels if choices else []


def _length_groups(samples: Sequence[Sample], order: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive runs of `order` (sorted by length) of at most `batch_tokens` padded tokens."""
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * len(samples[i].ids) <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _run_capturing(
    target: torch.nn.Module, runner: torch.nn.Module, layers: Sequence[int], input_ids: torch.Tensor, mask: torch.Tensor
) -> dict[int, torch.Tensor]:
    """Hidden states `layers` of one forward pass of `runner` (the target or its shallow part),
    captured by hooks on the target's own modules."""
    captured: dict[int, torch.Tensor] = {}
    handles = capture_hidden_states(target, layers, captured)
    try:
        runner(input_ids=input_ids, attention_mask=mask, position_ids=position_ids(mask), logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    return captured
