"""Save points an engine serves in place: for engines whose kernels write a step's final state
into the running slot (vLLM's Mamba layers) instead of copying it to a save slot.

Kept apart from :mod:`hybridcache.manager`: the manager's own path never needs these; the vLLM
adapter does (see ``docs/vllm.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybridcache.errors import InvalidRequestError

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.requests import Request


class SavePointControl:
    """Relabel or drop a request's save points (mixed into the manager)."""

    # Provided by the manager.
    arena: Any
    _get: Callable[[str], Request]

    def save_in_running_slot(self, request_id: str, boundary: int) -> int:
        """Serve a save point without a copy: the state at ``boundary`` will be left in the
        running slot at the end of this step.

        Engines whose kernels write the step's final state in place (vLLM's Mamba layers)
        save at a step end by relabelling: the running slot becomes the save point's slot
        and the save point's fresh slot becomes the running one. Valid only when
        ``boundary`` is the end of the step just allocated.

        Returns:
            The new running slot: the engine must copy the state into it before the next
            step computes (vLLM's copy-on-extend does exactly that).
        """
        req = self._get(request_id)
        if boundary != req.num_allocated:
            raise InvalidRequestError(
                f"request {request_id!r}: save at {boundary} is not the end of the step "
                f"({req.num_allocated})"
            )
        if boundary == req.rolling_boundary and req.rolling_slot >= 0:
            req.rolling_slot, req.slot = req.slot, req.rolling_slot
        elif boundary in req.saves:
            req.saves[boundary], req.slot = req.slot, req.saves[boundary]
        else:
            raise InvalidRequestError(f"request {request_id!r}: no save point at {boundary}")
        return req.slot

    def cancel_save(self, request_id: str, boundary: int) -> None:
        """Drop a save point the engine cannot honour; no snapshot is registered for it."""
        req = self._get(request_id)
        if boundary == req.rolling_boundary:
            req.rolling_boundary = -1
        elif boundary in req.saves:
            self.arena.free_slot(req.saves.pop(boundary))
        else:
            raise InvalidRequestError(f"request {request_id!r}: no save point at {boundary}")
