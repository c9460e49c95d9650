"""What a Kimi-K3 checkpoint's ``config.json`` promises about its routed experts.

The MoE layers (the MTP draft's included), the experts per layer, their
widths, the checkpoint names vLLM's Kimi-K3 loader maps, and the format
(``vllm_kimi_k3_moe.formats``) whose tensor contracts every expert tensor is
held to. No torch, no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe.formats import CheckpointFormat, FormatError, recognise
from vllm_kimi_k3_moe.formats.adapters import (
    ADAPTERS,
    adapter_contracts,
    adapters_quantized,
)
from vllm_kimi_k3_moe.formats.bf16 import TENSORS as BF16_TENSORS
from vllm_kimi_k3_moe.formats.layouts import TensorContract
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    ConfigFileError,
    declared_quantization_config,
    language_model_fields,
    main_moe_layers,
    mtp_moe_layers,
    read_config_document,
    text_config_fields,
)

CONFIG_FILE = "config.json"
MODELOPT_CONFIG_FILE = "hf_quant_config.json"
# vLLM's Kimi-K3 models load text weights from these checkpoint prefixes: the
# multimodal checkpoint (config nests text_config) and a text-only one.
MULTIMODAL_PREFIX = "language_model.layers."
TEXT_ONLY_PREFIX = "model.layers."


class PreflightInputError(ValueError):
    """Input the preflight cannot work on; the message is one line."""


@dataclass(frozen=True)
class KimiK3Layout:
    """The routed experts a Kimi-K3 config promises."""

    text_config: dict[str, Any]
    format: CheckpointFormat
    prefix: str
    declared_in: str = CONFIG_FILE  # the file the format was read from
    # the whole language model's config, read only when asked (--moe-backend)
    language_model: dict[str, Any] | None = None
    # config.json's quantization_config (None: none, or ModelOpt's own file),
    # which vLLM builds the experts' method from
    quantization_config: dict[str, Any] | None = None
    # whether the config quantizes the latent adapters (``formats.adapters``)
    adapters_quantized: bool = False

    @property
    def hidden(self) -> int:
        routed = self.text_config.get("routed_expert_hidden_size")
        return routed or self.text_config["hidden_size"]

    @property
    def intermediate(self) -> int:
        return self.text_config["moe_intermediate_size"]

    @property
    def num_experts(self) -> int:
        return self.text_config["num_experts"]

    @property
    def main_layers(self) -> list[int]:
        return main_moe_layers(self.text_config)

    @property
    def mtp_layers(self) -> list[int]:
        return mtp_moe_layers(self.text_config)

    @property
    def layers(self) -> list[int]:
        """Every MoE layer whose experts the checkpoint holds."""
        return [*self.main_layers, *self.mtp_layers]

    def expert_prefix(self, layer: int, expert: int) -> str:
        """What every checkpoint key of one expert starts with."""
        return f"{self.prefix}{layer}.block_sparse_moe.experts.{expert}."

    def contracts(
        self, fmt: CheckpointFormat | None = None
    ) -> list[tuple[str, TensorContract]]:
        """("w1.weight_packed", its contract) for every tensor of one expert
        in ``fmt`` (default: the declared format), in checkpoint order."""
        fmt = fmt or self.format
        return [
            (f"{projection}.{suffix}", contract)
            for (projection, suffix), contract in fmt.tensors.contracts(
                self.hidden, self.intermediate
            ).items()
        ]

    @property
    def has_adapters(self) -> bool:
        """Latent MoE: vLLM builds the two adapters in every MoE layer."""
        return self.text_config.get("routed_expert_hidden_size") is not None

    def adapter_contracts(self) -> list[tuple[str, TensorContract]]:
        """("routed_expert_up_proj.weight_packed", its contract) for every
        tensor of one layer's adapters: as the format stores an expert's
        down projection where the config quantizes them, else BF16."""
        if not self.has_adapters:
            return []
        tensors = self.format.tensors if self.adapters_quantized else BF16_TENSORS
        hidden = self.text_config["hidden_size"]
        return [
            (f"{adapter}.{suffix}", contract)
            for adapter in ADAPTERS
            for suffix, contract in adapter_contracts(
                tensors, adapter, hidden, self.hidden
            ).items()
        ]

    def adapter_prefix(self, layer: int) -> str:
        """What every checkpoint key of one layer's adapters starts with."""
        return f"{self.prefix}{layer}.block_sparse_moe."

    @property
    def expected_tensors(self) -> int:
        per_expert = len(self.format.tensors.contracts(self.hidden, self.intermediate))
        return len(self.layers) * self.num_experts * per_expert


def read_layout(directory: Path, language_model: bool = False) -> KimiK3Layout:
    """The expert layout promised by ``directory``'s ``config.json`` (and,
    if asked, the whole language model's config, for building it)."""
    config_path = directory / CONFIG_FILE
    try:
        document = read_config_document(config_path)
        text_config = text_config_fields(document, config_path)
        whole = language_model_fields(document, config_path) if language_model else None
    except ConfigFileError as error:
        raise PreflightInputError(str(error)) from None
    nested = document.get("text_config")
    quantization_config = declared_quantization_config(document)
    hf_quant_config = None
    if (directory / MODELOPT_CONFIG_FILE).is_file():
        try:
            hf_quant_config = read_config_document(directory / MODELOPT_CONFIG_FILE)
        except ConfigFileError as error:
            raise PreflightInputError(str(error)) from None
    try:
        fmt = recognise(quantization_config, hf_quant_config, str(config_path))
    except FormatError as error:
        raise PreflightInputError(str(error)) from None
    return KimiK3Layout(
        text_config=text_config,
        format=fmt,
        prefix=MULTIMODAL_PREFIX if nested is not None else TEXT_ONLY_PREFIX,
        declared_in=(
            MODELOPT_CONFIG_FILE if isinstance(hf_quant_config, dict) else CONFIG_FILE
        ),
        language_model=whole,
        quantization_config=(
            quantization_config if isinstance(quantization_config, dict) else None
        ),
        adapters_quantized=adapters_quantized(quantization_config, hf_quant_config),
    )


def layer_ranges(layers: list[int]) -> str:
    """``[1, 2, ..., 92]`` as "1-92"; anything else listed."""
    if len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(map(str, layers)) or "none"
