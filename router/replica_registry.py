"""The backends' request routers (`router.replica_router`) alive in this process, by deployment
name: how the Router's core learns how many replicas each backend's handle routes over. Apart from
the router class because Serve pickles that class's module by value: state kept there would be a
copy, not this process's."""

from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(deployment: str, router: Any) -> None:
    """`router` (a Serve `RequestRouter`) routes `deployment`'s requests in this process."""
    _ROUTERS[deployment] = router


def replica_counts() -> dict[str, int]:
    """Replicas each backend deployment's handle in this process routes over (absent: not yet known)."""
    return {name: len(router.curr_replicas) for name, router in list(_ROUTERS.items()) if router.curr_replicas}
