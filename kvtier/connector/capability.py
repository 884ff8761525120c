"""Whether kvtier may serve this engine at all: the engine can compute on a cached prefix, and kvtier knows what
computes its KV. Every hit depends on both.

kvtier's hit makes the engine prefill only the tokens after the loaded prefix. kvtier reads the engine's own
decision instead of a list of models:

- vLLM turns prefix caching and chunked prefill both off when its attention cannot prefill after a computed
  prefix (its CPU platform for MLA without AMX, whose reference backend prefills from scratch; models with
  non-causal attention): kvtier never serves such an engine.
- vLLM turns prefix caching alone off for models whose KV is not a function of the prefix alone (e.g. windows
  over generated tokens), and operators turn it off by choice; kvtier cannot tell the two apart, so it serves an
  engine without prefix caching only when its config says ``serve_without_prefix_caching: true``.
- A hybrid model's recurrent state (Mamba, linear attention) exists at block boundaries only when vLLM runs
  ``mamba_cache_mode="align"``; in any other mode kvtier cannot restore a prefix of such a model.

A blocked engine gets no lookups and no saves (records saved there would only serve engines of the same kind,
which cannot use them either), and one warning at start says why.
"""

from __future__ import annotations

from kvtier.connector.settings import EngineSettings
from kvtier.layout import GroupKind, KVCacheConfig


def prefix_resume_blocker(engine: EngineSettings, serve_without_prefix_caching: bool = False) -> str | None:
    """Why kvtier must not serve this engine's prefixes, or None when it may (engines without these settings,
    such as kvtier's reference engine, always may)."""
    prefix, chunked = engine.prefix_caching, engine.chunked_prefill
    if prefix is False and chunked is False:
        return ("the engine runs with prefix caching and chunked prefill both off, which vLLM does when its "
                "attention cannot prefill after a cached prefix for this model (e.g. its CPU MLA backend without "
                "AMX); enable either one if the engine supports it")
    if prefix is False and not serve_without_prefix_caching:
        return ("the engine runs with its prefix cache off, which vLLM also does for models whose KV cannot be "
                "reused from a prefix; if you turned it off yourself, set serve_without_prefix_caching: true in "
                "kvtier's config (or turn the engine's prefix caching on)")
    return None


def state_blocker(engine: EngineSettings, kcc: KVCacheConfig) -> str | None:
    """Why kvtier must not serve a hybrid model's recurrent (Mamba / linear-attention) groups: the engine keeps no
    state at block boundaries unless vLLM runs ``mamba_cache_mode="align"`` (its default with prefix caching on).
    Engines that do not say (kvtier's reference engine) keep them."""
    hybrid = any(g.kind is GroupKind.MAMBA for g in kcc.kv_cache_groups)
    if not hybrid or engine.mamba_cache_mode in (None, "align"):
        return None
    return (f"the engine keeps this model's recurrent state only per request (mamba_cache_mode="
            f"{engine.mamba_cache_mode!r}), so no prefix of it can be restored; run vLLM with prefix caching on, or "
            "--mamba-cache-mode align")


def weights_blocker(fingerprint: str | None) -> str | None:
    """Why kvtier must not serve, when the model's weights could not be fingerprinted (kvtier.records.fingerprint)."""
    if fingerprint is None:
        return ("kvtier cannot tie records to this model's weights (see the warning above); set namespace.weights: "
                "off, and namespace.revision to your deployment's version, to cache it")
    return None
