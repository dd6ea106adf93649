"""Hydra's record of a run with the checkpoint's secrets redacted.

Hydra writes the run's configuration and command line into `<run dir>/.hydra/` (config.yaml,
overrides.yaml, hydra.yaml) before the recipe's main() runs. Credentials given as
`+checkpoint.remote.storage_options.*` overrides would stay there verbatim, in a directory
the job's logs and metrics are shared from. The recipe rewrites those files first thing,
each secret value (what verl_ckpt.protocol.redaction hides: every storage option but the
endpoint and region, any secret-looking key, and a URL's password) replaced by `<redacted>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from omegaconf import DictConfig, OmegaConf

from verl_ckpt.protocol.redaction import REDACTED, has_password, redacted
from verl_ckpt.store.fsio import atomic_write_bytes

__all__ = ["redact_hydra_records", "secret_values"]

# A shorter value is not replaced: it would rewrite unrelated text of the record, and no
# credential is that short.
_MIN_SECRET_CHARS = 4


def secret_values(settings: Any, shown: Any = None) -> list[str]:
    """The values of `settings` that redaction hides (walked beside its redacted copy)."""
    if shown is None:
        shown = redacted(settings)
    if isinstance(settings, Mapping):
        return [v for k, item in settings.items() for v in secret_values(item, shown[k])]
    if isinstance(settings, (list, tuple)):
        return [v for item, s in zip(settings, shown) for v in secret_values(item, s)]
    if shown == REDACTED and settings is not None and len(str(settings)) >= _MIN_SECRET_CHARS:
        return [str(settings)]
    if isinstance(settings, str) and has_password(settings):
        # A URL's password, as it is written in the URL (and so in the records).
        password = urlsplit(settings).password or ""
        return [password] if len(password) >= _MIN_SECRET_CHARS else [settings]
    return []


def redact_hydra_records(dict_cfg: DictConfig) -> None:
    """Rewrite the run's `.hydra/*.yaml` with the checkpoint settings' secrets redacted
    (nothing to do without a Hydra run or without secrets)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if not hydra_cfg.output_subdir:
        return
    checkpoint = OmegaConf.to_container(dict_cfg.get("checkpoint", {}), resolve=False)
    secrets = sorted(set(secret_values(checkpoint)), key=len, reverse=True)
    if not secrets:
        return
    records = Path(hydra_cfg.runtime.output_dir) / hydra_cfg.output_subdir
    for path in sorted(records.glob("*.yaml")):
        text = path.read_text()
        clean = text
        for secret in secrets:  # longest first: a secret holding another is replaced whole
            clean = clean.replace(secret, REDACTED)
        if clean != text:
            atomic_write_bytes(path, clean.encode())
