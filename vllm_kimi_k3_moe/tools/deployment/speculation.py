"""``--speculative-config``: the draft a Kimi-K3 deployment speculates with.

``plan`` takes vLLM's ``--speculative-config`` JSON as ``vllm serve`` does
and sizes what the draft adds: vLLM builds it (``tools/meta_rank/draft.py``)
from its ``config.json``. Before vLLM is imported this refuses, in one line,
what cannot be sized: JSON that is not an object, a method ``plan`` does not
size (DSpark and Kimi-K3's MTP are), a DSpark spec without its draft, a
draft that is neither a directory holding a ``config.json`` nor a public
draft whose config is kept (``public_drafts``), an MTP spec on a config
without MTP layers (vLLM divides by their count). The rest is vLLM's to
refuse (``SpeculativeConfig``: unknown keys, the token count, pipeline
parallelism the draft does not support). Plain Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe.tools.deployment.public_drafts import NOT_KEPT, PUBLIC_DRAFTS
from vllm_kimi_k3_moe.tools.deployment.topology import DeploymentError

# The methods plan sizes: Kimi-K3's drafts in vLLM 0.33.0
# (models/kimi_k3/nvidia/dspark_mla.py, models/kimi_k3/nvidia/mtp.py).
METHODS = ("dspark", "mtp")
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class Speculation:
    """A ``--speculative-config``: as given (for the serve lines), and the
    draft's ``config.json`` where it is not the target's (MTP)."""

    spec: dict[str, Any]  # the JSON object, as vLLM takes it
    draft_config: dict[str, Any] | None  # None: the target's own (MTP)

    @property
    def method(self) -> str:
        return self.spec["method"]


def read_speculative_config(text: str, text_config: dict[str, Any]) -> Speculation:
    """``--speculative-config``'s value, validated (``DeploymentError``)."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as error:
        raise DeploymentError(f"--speculative-config is not JSON: {error}") from None
    if not isinstance(spec, dict):
        raise DeploymentError(
            f"--speculative-config must be a JSON object, got {text[:40]!r}"
        )
    method = spec.get("method")
    if method not in METHODS:
        raise DeploymentError(
            f"--speculative-config method {method!r}: plan sizes Kimi-K3's drafts, "
            f"method {' or '.join(map(repr, METHODS))}"
        )
    model = spec.get("model")
    if method == "mtp":
        return _mtp(spec, model, text_config)
    if not isinstance(model, str):
        raise DeploymentError(
            '--speculative-config: DSpark needs its draft, "model": a directory '
            f"holding its {CONFIG_FILE}, or {', '.join(PUBLIC_DRAFTS)}"
        )
    return Speculation(spec, draft_config(model))


def draft_config(model: str) -> dict[str, Any]:
    """The ``config.json`` of the draft ``model`` names: a local
    directory's, or a public draft's kept here."""
    directory = Path(model)
    if directory.is_dir():
        path = directory / CONFIG_FILE
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise DeploymentError(
                f"--speculative-config model {model}: cannot read its "
                f"{CONFIG_FILE} ({type(error).__name__}: {error})"
            ) from None
        if not isinstance(config, dict):
            raise DeploymentError(f"{path} is not a JSON object")
        return config
    if model in PUBLIC_DRAFTS:
        return PUBLIC_DRAFTS[model].config
    fetch = f"hf download {model} {CONFIG_FILE} --local-dir DIR"
    if model in NOT_KEPT:
        raise DeploymentError(
            f"--speculative-config model {model}: {NOT_KEPT[model]}; give a "
            f'directory holding it instead ({fetch}, then "model": "DIR")'
        )
    raise DeploymentError(
        f"--speculative-config model {model!r} is neither a directory nor a "
        f"public draft plan knows ({', '.join(PUBLIC_DRAFTS)}); give a directory "
        f"holding its {CONFIG_FILE} ({fetch})"
    )


def _mtp(spec: dict[str, Any], model: Any, text_config: dict[str, Any]) -> Speculation:
    """Kimi-K3's MTP draft is the target's own MTP layers: vLLM builds it
    from the target's config (``model``, when given, is the target's)."""
    layers = text_config.get("num_nextn_predict_layers") or 0
    if layers < 1:
        raise DeploymentError(
            "--speculative-config method 'mtp': this Kimi-K3 config has "
            f"num_nextn_predict_layers {layers}, no MTP layer to draft with (the "
            "released config has none); give the config.json of a checkpoint "
            "with them (--config)"
        )
    if model is not None and not Path(str(model)).is_dir():
        raise DeploymentError(
            f"--speculative-config model {model!r}: an MTP draft is the target's "
            "own layers; drop model, or name the target's directory"
        )
    return Speculation(spec, None)
