"""Adapters: specs from Hugging Face configs (:mod:`.hf`), the vLLM scheduler plug-in
(:mod:`.vllm`, needs the ``vllm`` extra) and the reference hybrid model (:mod:`.reference`).

Nothing is imported here, so that ``import hybridcache.adapters.hf`` never pulls in vLLM or
the reference model's torch code.
"""
