"""Trained drafters' weights: the networks (EAGLE head, Medusa heads, early-exit adapter), the
JSON card that travels with them, checked against the target's fingerprint
(`backends.models.weights_fingerprint`) that ties a drafter to the target it learned from."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from transformers import LlamaModel, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from policies.drafters import TrainedKind, resolve, spec

from ..errors import ModelLoadError
from ..models import weights_fingerprint


class DraftVocab(torch.nn.Module):
    """The target's LM head restricted to the tokens a drafter may propose (frozen, derived from
    the target at load time, never saved). Logits come back over the full vocabulary, -inf
    outside the draft vocabulary: q is zero there, which the rejection rule handles exactly."""

    def __init__(self, lm_head_weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = lm_head_weight.shape[0]
        self.register_buffer("ids", ids.to(torch.long), persistent=False)
        self.register_buffer("weight", lm_head_weight.detach()[ids].to(dtype).clone(), persistent=False)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary only, (…, Vd): what training uses."""
        return hidden.to(self.weight.dtype) @ self.weight.T

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.draft_logits(hidden).float()
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.ids] = small
        return full


@dataclass
class DraftOutput:
    logits: torch.Tensor  # (B, T, V) over the full vocabulary
    hidden: torch.Tensor  # (B, T, H): what the next autoregressive step reads (EAGLE)


class EagleNet(torch.nn.Module):
    """EAGLE's draft network: at position i it reads the target's last hidden state f_i and the
    embedding of the token after it, and predicts f_{i+1}, whose LM-head logits draft token i+2.
    Drafting continues on its own predicted features. The token embedding and LM head are the
    target's (frozen, not part of the saved weights)."""

    def __init__(self, target_config: PretrainedConfig, intermediate_size: int):
        super().__init__()
        config = copy.deepcopy(target_config)
        config.num_hidden_layers = 1
        config.intermediate_size = intermediate_size
        config.vocab_size = 1  # inputs arrive as embeddings: no embedding table of its own
        config.pad_token_id = None
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:1]
        hidden = config.hidden_size
        self.config = config
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=True)
        self.decoder = LlamaModel(config)
        self.decoder.embed_tokens.requires_grad_(False)  # a 1-row stub: inputs come as embeddings
        self.embed: torch.nn.Embedding | None = None
        self.head: DraftVocab | None = None

    @classmethod
    def from_card(cls, card: DrafterCard, target: PreTrainedModel) -> EagleNet:
        return cls(target.config, card.width)

    def attach(self, embed: torch.nn.Embedding, head: DraftVocab) -> None:
        """Borrow the target's embedding and the draft-vocabulary LM head (not registered as
        submodules, so they are neither trained nor saved)."""
        object.__setattr__(self, "embed", embed)
        object.__setattr__(self, "head", head)

    def hidden(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        assert self.embed is not None, "attach() the target's embedding first"
        dtype = self.fc.weight.dtype
        tokens = self.embed(input_ids).to(dtype)
        inputs = self.fc(torch.cat([features.to(dtype), tokens], dim=-1))
        out = self.decoder(
            inputs_embeds=inputs,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> DraftOutput:
        """The interface `PagedCache` drives (logits_to_keep as in transformers)."""
        assert self.head is not None
        hidden = self.hidden(input_ids, features, attention_mask, position_ids, cache)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden = hidden[:, keep]
        return DraftOutput(self.head(hidden), hidden)


class ResidualBlock(torch.nn.Module):
    """x + SiLU(W x): Medusa's head block, and the early-exit adapter (zero-initialised, so an
    untrained adapter is exactly the plain early exit)."""

    def __init__(self, size: int, zero_init: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(size, size)
        if zero_init:
            torch.nn.init.zeros_(self.linear.weight)
            torch.nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(self.linear(x))


class MedusaNet(torch.nn.Module):
    """Medusa: head j reads the target's last hidden state at the last verified position and
    predicts the token j + 1 places past the one the target itself predicts from it."""

    def __init__(self, hidden_size: int, heads: int):
        super().__init__()
        self.heads = torch.nn.ModuleList([ResidualBlock(hidden_size) for _ in range(heads)])

    @classmethod
    def from_card(cls, card: DrafterCard, target: PreTrainedModel) -> MedusaNet:
        return cls(card.hidden_size, card.heads)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(…, H) → (…, heads, H): what each head hands the LM head."""
        dtype = self.heads[0].linear.weight.dtype
        return torch.stack([head(features.to(dtype)) for head in self.heads], dim=-2)


class ExitAdapter(torch.nn.Module):
    """Between the target's layer L and its final norm: a bottleneck residual MLP trained so that
    norm + LM head of the shallow state agree with the full target."""

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.down = torch.nn.Linear(hidden_size, width)
        self.up = torch.nn.Linear(width, hidden_size)
        torch.nn.init.zeros_(self.up.weight)  # untrained = the plain early exit
        torch.nn.init.zeros_(self.up.bias)

    @classmethod
    def from_card(cls, card: DrafterCard, target: PreTrainedModel) -> ExitAdapter:
        return cls(card.hidden_size, card.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(self.down.weight.dtype)
        return (h + self.up(torch.nn.functional.silu(self.down(h)))).to(dtype)


class AdaptedNorm(torch.nn.Module):
    """The target's final norm preceded by the adapter: dropped in for `model.norm` of the
    shallow model, so the early-exit drafter is an ordinary causal LM to the engine."""

    def __init__(self, adapter: ExitAdapter, norm: torch.nn.Module):
        super().__init__()
        self.adapter, self.norm = adapter, norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.adapter(x))


DEFAULTS_DIR = Path(__file__).parent / "defaults"


class HeldOut(BaseModel):
    """How the drafter did on prompts whose topics it never trained on."""

    model_config = ConfigDict(extra="forbid")

    top1_by_position: list[float] = Field(description="teacher-forced agreement with the target, draft positions 1…")
    alpha_by_category: dict[str, float] = Field(default_factory=dict, description="α in speculative runs, per category")
    alpha_k: int = Field(0, description="the k those runs drafted at")
    coverage: float = Field(description="share of held-out target tokens inside the draft vocabulary")
    untrained_top1: float = Field(description="position-1 agreement of the same network before training")


class DrafterCard(BaseModel):
    """The JSON that travels with a trained drafter's safetensors."""

    model_config = ConfigDict(extra="forbid")

    kind: TrainedKind
    target: str
    fingerprint: str
    vocab_size: int
    hidden_size: int
    draft_vocab_size: int
    layers: list[int] = Field(description="target hidden-state indices the drafter reads (early exit: its exit layer)")
    heads: int = 0
    width: int = Field(0, description="EAGLE: MLP width of its decoder layer; adapter: bottleneck width")
    dtype: str = Field("bfloat16", description="dtype of the saved weights")
    parameters: int
    held_out: HeldOut
    data: dict[str, Any] = Field(default_factory=dict, description="prompts, sequences and tokens per split")
    training: dict[str, Any] = Field(default_factory=dict, description="steps, seconds, best step, settings")
    command: str = ""
    created: str = ""


@dataclass
class TrainedDrafter:
    card: DrafterCard
    net: torch.nn.Module
    head: DraftVocab


def card_path(weights: Path) -> Path:
    return weights.with_suffix(".json")


def default_weights(kind: TrainedKind, target_name: str) -> Path:
    return DEFAULTS_DIR / target_name.lower() / f"{kind}.safetensors"


def resolve_weights(source: str | None, kind: TrainedKind, target_name: str) -> Path:
    """`source` may be None/'default' (the drafter shipped for this target), a directory holding
    `<kind>.safetensors`, or the .safetensors file itself."""
    if source in (None, "default"):
        path = default_weights(kind, target_name)
        if not path.exists():
            raise ModelLoadError(
                f"no {kind} drafter ships for {target_name!r}: train one with "
                f"`specroute train-drafter --kind {kind} --out DIR` and pass its path"
            )
        return path
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / f"{kind}.safetensors"
    if not path.exists() or not card_path(path).exists():
        raise ModelLoadError(f"no trained {kind} drafter at {path} (need the .safetensors and its .json card)")
    return path


def save_drafter(path: Path, card: DrafterCard, net: torch.nn.Module, draft_ids: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in net.state_dict().items()}
    tensors["draft_vocab"] = draft_ids.to(torch.int64).contiguous()
    save_file(tensors, str(path), metadata={"kind": card.kind, "fingerprint": card.fingerprint})
    card_path(path).write_text(card.model_dump_json(indent=2) + "\n", encoding="utf-8")


def build_net(card: DrafterCard, target: PreTrainedModel) -> torch.nn.Module:
    """The untrained network of the card's kind (the registry names its class), sized as the card says."""
    network = spec(card.kind).network
    assert network is not None, f"the registry names no network for {card.kind}"
    return resolve(network).from_card(card, target)


def load_drafter(
    path: Path, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype
) -> TrainedDrafter:
    """Weights + card, checked against the target's fingerprint; the draft-vocabulary LM head
    is cut from the target's own head."""
    try:
        card = DrafterCard.model_validate_json(card_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read the drafter card {card_path(path)}: {error}") from error
    mine = weights_fingerprint(target, tokenizer)
    if card.fingerprint != mine:
        raise ModelLoadError(
            f"the {card.kind} drafter at {path} was trained for another target ({card.target}, fingerprint "
            f"{card.fingerprint[:12]}); this target's fingerprint is {mine[:12]}: train a drafter for it with "
            f"`specroute train-drafter --kind {card.kind}`"
        )
    tensors = load_file(str(path))
    draft_ids = tensors.pop("draft_vocab")
    net = build_net(card, target)
    net.load_state_dict(tensors)
    net.to(device=next(target.parameters()).device, dtype=dtype).eval().requires_grad_(False)
    head = DraftVocab(target.get_output_embeddings().weight, draft_ids.to(next(target.parameters()).device), dtype)
    if isinstance(net, EagleNet):
        net.attach(target.get_input_embeddings(), head)
    return TrainedDrafter(card, net, head)
