"""Eviction policy implementations; import them through ``kvtier.control.policy`` (registry, ``make_policy``)."""
