"""The dtype the service's target runs in, decided from the profiles this machine has (the rule is
`policies.serving_dtype`'s; this finds the profiles and says why one is missing). Used by the
service before any replica starts and by `specroute advise`."""

from __future__ import annotations

from pathlib import Path

from policies.config import PolicyConfig
from policies.profile import Profile
from policies.quantization import REDUCED_PRECISION
from policies.serving_dtype import SERVED_DTYPES, DtypeChoice, choose_dtype, configured
from profiler.hardware import NO_FAST_BF16, fast_reduced_precision
from profiler.profiling import default_profile_path


def decide_dtype(model: str, dtype: str, device: str, profile: str | None, policy: PolicyConfig) -> DtypeChoice:
    """A dtype the settings name stays; with auto, an explicit profile's dtype, else the exact dtype
    this machine's profiles predict faster (float32 when only that one is profiled)."""
    if profile:
        given = Profile.load(Path(profile))
        chosen = given.model.dtype if dtype == "auto" else dtype
        return configured(chosen, [given], policy, f"{chosen}: the dtype of the profile given ({profile})")
    paths = {d: default_profile_path(model, d, device) for d in SERVED_DTYPES}
    profiles = [Profile.load(path) for path in paths.values() if path.is_file()]
    if dtype != "auto":
        return configured(dtype, profiles, policy)
    return choose_dtype(profiles, policy, why_missing([d for d, p in paths.items() if not p.is_file()], device))


def why_missing(dtypes: list[str], device: str) -> str | None:
    """Why each dtype `auto` could pick has no profile here (part of the choice's reason)."""
    reasons = []
    for dtype in dtypes:
        if dtype in REDUCED_PRECISION and not fast_reduced_precision(device):
            reasons.append(f"{dtype} not profiled: {NO_FAST_BF16}")
        else:
            reasons.append(f"{dtype} not profiled on this machine yet (`specroute profile --dtype {dtype}` adds it)")
    return "; ".join(reasons) or None
