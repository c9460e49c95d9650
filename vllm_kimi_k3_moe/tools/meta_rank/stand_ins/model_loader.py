"""Stands in for vLLM's model loader (``get_model``) when the tools build a
speculative-decoding draft with vLLM's own draft loaders.

Why: the tools have no weights and no GPU. What the real loader guarantees
and is kept: the draft is built by ``initialize_model`` under the draft
config vLLM made, and what the draft loaders do around it (the draft's
config, sharing the target's embedding and ``lm_head``) is vLLM's; only the
loading is left out, and the draft is built on ``meta``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes


@contextmanager
def weightless_model_loader() -> Iterator[None]:
    """``vllm.model_executor.model_loader.get_model`` (and the name
    ``load_eagle_model``'s module imported it under), which vLLM's draft
    loaders (``load_dspark_model``, ``load_eagle_model``) call to build and
    load the draft, builds it as the loader does (``initialize_model`` under
    the draft's config, its dtype the default) on the ``meta`` device and
    loads nothing: the tools have no weights. What the loaders do around it
    (the draft's config, sharing the target's embedding and ``lm_head``) is
    vLLM's. Holds no parameters."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    def build_only(
        *,
        vllm_config: Any,
        model_config: Any = None,
        prefix: str = "",
        load_config: Any = None,
    ) -> Any:
        model_config = model_config or vllm_config.model_config
        with (
            set_current_vllm_config(vllm_config),
            set_default_torch_dtype(model_config.dtype),
            torch.device("meta"),
        ):
            return initialize_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix
            )

    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    # load_dspark_model imports get_model when called, load_eagle_model (MTP)
    # when its module is imported: both names are replaced
    with (
        replaced_attributes(model_loader, get_model=build_only),
        replaced_attributes(eagle_utils, get_model=build_only),
    ):
        yield
