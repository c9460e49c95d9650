"""Patches on vLLM's in-place weight updates (``vllm/model_executor/
model_loader/reload/``), one module per upstream file: where an update
starts (``layerwise``: both releases; ``direct``: vLLM 0.34's direct mode)
and what a vLLM 0.34 load plan writes without the loaders (``plan``). What an
update that fails leaves is put back by ``model_executor.models.utils``."""
