"""torchship run's settings: each stage's own defaults, then a config file, then --set, then the shortcut flags."""

from __future__ import annotations

import json
from typing import Any

from ..errors import ConfigError

SECTIONS = ("train", "export", "repo", "serve", "bench", "run")


def resolve_settings(file_cfg: dict[str, Any], sets: list[str], shortcuts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each stage config's own defaults < config file < --set SECTION.KEY=VALUE < shortcut flags."""
    out: dict[str, dict[str, Any]] = {k: {} for k in SECTIONS}
    for section, values in file_cfg.items():
        if section not in out:
            raise ConfigError(f"--config: unknown section [{section}]; use {', '.join(out)}")
        if not isinstance(values, dict):
            raise ConfigError(f"--config: [{section}] must be a table of options")
        out[section].update(values)
    for item in sets:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r} must look like SECTION.KEY=VALUE (e.g. train.epochs=3)")
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        if section not in out:
            raise ConfigError(f"--set {item}: unknown section {section!r}; use {', '.join(out)}")
        try:
            out[section][name.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[section][name.replace("-", "_")] = value
    out["train"].update({k: v for k, v in shortcuts.items() if v is not None})
    return out
