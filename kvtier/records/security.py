"""Record signing keys: the optional HMAC-SHA256 key that signs every record written to disk and Redis.

``security.hmac_key_env`` names an environment variable; its value (the raw bytes of the string, at least
``MIN_KEY_BYTES`` of them) is the key. Records are then signed when written and refused when read unless
signed with the same key: a writer without the key (or with another one) cannot plant KV in a shared tier.
The key's value never appears in errors or logs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvtier.config import SecurityConfig
from kvtier.errors import ConfigError

MIN_KEY_BYTES = 16  # 128 bits; `openssl rand -hex 32` gives 64


def load_hmac_key(security: SecurityConfig, env: Mapping[str, str] | None = None) -> bytes | None:
    """The signing key named by ``security.hmac_key_env`` (None when signing is off).

    Raises ``ConfigError`` (path ``security.hmac_key_env``) when the variable is unset, empty or too short.
    """
    var = security.hmac_key_env
    if not var:
        return None
    value = (os.environ if env is None else env).get(var)
    if not value:
        raise ConfigError("security.hmac_key_env", f"names ${var}, which is not set or empty",
                          f"export {var}=$(openssl rand -hex 32), the same value on every host sharing the tiers")
    key = value.encode()
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError("security.hmac_key_env", f"${var} holds {len(key)} bytes; a signing key needs at "
                          f"least {MIN_KEY_BYTES}", f"export {var}=$(openssl rand -hex 32)")
    return key
