"""Eviction policy implementations; import them through ``kvtier.policy`` (registry, ``make_policy``)."""
