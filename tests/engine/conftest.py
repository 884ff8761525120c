"""Make ``dict_connector`` importable by module path (the factory and MultiConnector load it that way)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
