"""Building a drafter from a `DrafterConfig`: what the CLI, the profiler and the service all use.
Which code builds which kind is the registry's to say (`policies.drafters`)."""

from __future__ import annotations

from policies.drafters import DrafterConfig, resolve, spec

from ..models import LoadedModel
from .drafters import Drafter


def build_drafter(config: DrafterConfig, target: LoadedModel) -> Drafter:
    return resolve(spec(config.kind).build)(config, target)
