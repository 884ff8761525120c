"""Whether the engine can compute a prompt on top of a cached prefix: the precondition of every hit.

kvtier's hit makes the engine prefill only the tokens after the loaded prefix. An engine whose attention cannot
prefill after a computed prefix would compute those tokens without the prefix's context and answer wrongly.
kvtier reads the engine's own decision instead of a list of models: vLLM turns both prefix caching and chunked
prefill off exactly when its attention cannot do that for the model (its CPU platform for MLA without AMX, whose
reference MLA backend prefills from scratch; models with non-causal attention; encoder-only models). A user who
turns both off is treated the same: kvtier then neither loads nor saves (records saved there would only serve
engines of the same kind, which cannot use them either) and says so once.
"""

from __future__ import annotations

from typing import Any


def prefix_resume_blocker(vllm_config: Any) -> str | None:
    """Why the engine cannot compute on a cached prefix, or None when it can (or does not say: engines without
    these settings, such as kvtier's reference engine, always can)."""
    prefix = getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", None)
    chunked = getattr(getattr(vllm_config, "scheduler_config", None), "enable_chunked_prefill", None)
    if prefix is False and chunked is False:
        return ("the engine runs with prefix caching and chunked prefill both off, which vLLM does when its "
                "attention cannot prefill after a cached prefix for this model (e.g. its CPU MLA backend without "
                "AMX); enable either one if the engine supports it")
    return None
