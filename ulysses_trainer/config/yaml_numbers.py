"""YAML as a user means it: `1e6`, `5e-5` and `1_000` are numbers.

PyYAML implements YAML 1.1, whose float pattern needs a dot and a signed exponent, so `1e6` and
`1e-4` come back as strings. This loader uses YAML 1.2's core-schema float pattern instead.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class NumberLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (exponents without a dot or a sign)."""


_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)
# copy the resolver table so plain yaml.SafeLoader keeps YAML 1.1's rules
NumberLoader.yaml_implicit_resolvers = {k: [r for r in v if r[0] != "tag:yaml.org,2002:float"]
                                        for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
NumberLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """yaml.safe_load, with numbers as a user writes them."""
    return yaml.load(text, Loader=NumberLoader)  # noqa: S506 - a SafeLoader subclass
