"""The engine's tenant table: each tenant's scheduling weight, changeable while the engine runs.
Requests name their tenant; one that names none belongs to DEFAULT_TENANT. The scheduling policy
reads the weights at every step, so a change applies to the next one. Pure Python."""

from __future__ import annotations

import math

from loraplex.errors import InvalidRequestError

DEFAULT_TENANT = "default"
"""The tenant of requests that name none (the offline API's, unless it says otherwise)."""
DEFAULT_WEIGHT = 1.0
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3
"""The weights a tenant may have. Service counters grow by tokens over the weight: a weight of
1e-300 would take one request's service to 1e301, where adding a step's tokens changes nothing
(float64) and the tenant would never be scheduled again beside the others."""


def check_weight(weight: object) -> float:
    """A tenant's weight as a float; InvalidRequestError names the range otherwise."""
    if (not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight)
            or not MIN_WEIGHT <= weight <= MAX_WEIGHT):
        raise InvalidRequestError(f"a tenant's weight must be a number from {MIN_WEIGHT:g} to "
                                  f"{MAX_WEIGHT:g}, not {weight!r}", param="weight")
    return float(weight)


class TenantTable:
    def __init__(self) -> None:
        self._weights: dict[str, float] = {}

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, DEFAULT_WEIGHT)

    def set_weight(self, tenant: str, weight: float) -> None:
        """A tenant's share under contention, relative to the others' (default 1)."""
        self._weights[tenant] = check_weight(weight)

    @property
    def weights(self) -> dict[str, float]:
        """Every tenant whose weight was set, with its weight."""
        return dict(self._weights)
