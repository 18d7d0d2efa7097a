"""ml_collections configs: `base.py` holds every field and its default; the others override."""

import dataclasses


def to_dataclass(cls, section):
    """Build dataclass `cls` from a config section whose keys must be exactly its fields."""
    names = {f.name for f in dataclasses.fields(cls)}
    keys = set(section.keys())
    if keys != names:
        raise ValueError(f"config section for {cls.__name__} differs from its fields: "
                         f"missing {sorted(names - keys)}, unknown {sorted(keys - names)}")
    return cls(**{k: section[k] for k in names})
