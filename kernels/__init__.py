"""State-copy kernels: execute the manager's copy plans for state snapshots and KV pages.

Public API:

* :func:`copy_states` - slot -> slot copies across every state tensor, one launch on CUDA;
* :func:`copy_kv_pages` - page -> page copies (optionally the first ``n`` tokens of a page);
* :func:`gather_to_host` / :func:`scatter_from_host` - device slots <-> host staging entries;
* :func:`staging_layout` / :func:`allocate_staging` / :func:`staging_views` - the staging buffer;
* :func:`normalize_plan` - the one accepted plan normaliser.

Every function takes ``backend="auto" | "torch" | "triton"``: ``auto`` runs the Triton kernel
on CUDA (when triton is installed) and the torch path elsewhere; results are bit-identical.
See docs/kernels.md for the plan format, memory layouts and measured numbers.
"""

from .device_copy import copy_kv_pages, copy_states
from .dispatch import BACKENDS, Backend, resolve_backend
from .errors import BackendError, LayoutError, PlanError
from .host_transfer import gather_to_host, scatter_from_host
from .plan import CopyPairs, PlanLike, normalize_plan, normalize_transfer
from .staging import STAGING_ALIGN, StagingLayout, allocate_staging, staging_layout, staging_views
from .torch_copy import BATCH_MAX_ROW_BYTES

__all__ = [
    "BACKENDS",
    "BATCH_MAX_ROW_BYTES",
    "STAGING_ALIGN",
    "Backend",
    "BackendError",
    "CopyPairs",
    "LayoutError",
    "PlanError",
    "PlanLike",
    "StagingLayout",
    "allocate_staging",
    "copy_kv_pages",
    "copy_states",
    "gather_to_host",
    "normalize_plan",
    "normalize_transfer",
    "resolve_backend",
    "scatter_from_host",
    "staging_layout",
    "staging_views",
]
