"""Copies between an engine's paged KV tensors and chunk payloads, one module per layout family.

:mod:`kvtier.kvcopy.blocked` moves the blocked layouts (``kv_first``, ``blocks_first``, ``mla``) with index ops;
:mod:`kvtier.kvcopy.paged` moves whole pages (``pages``, vLLM >= 0.32). :mod:`kvtier.kvcopy.transfer` checks the inputs
and picks the family; shapes and block ids come from :mod:`kvtier.layout.geometry`.
"""
