"""An in-place update from a checkpoint directory is held to its shard
headers before any tensor of it is written.

Used by the default loader's patch (``default_loader``) when vLLM reads a
running model's weights from disk: ``reload_weights(weights_path=...)``
(``collective_rpc("reload_weights")`` with a directory the trainer saved),
and EPLB's recovery from the checkpoint. The loaders refuse a malformed
tensor as it arrives (strict expert loading), but by then the layers the
update finished hold it: a malformed checkpoint leaves a mixture. A
directory can be seen whole first, as ``check`` sees it before a cold start:
each shard's header (``formats.safetensors_headers``: a few bytes per
tensor, no data) gives every tensor's name, dtype and shape. Before the first
tensor is handed on, every Kimi-K3 routed-expert tensor is held to its
layer's contract, and each expert's units (w1 and w3 with all their tensors,
w2 with all of its: what the kernel keeps together, ``partial_updates``) must
be in it whole or not at all. A breach refuses the update with nothing
written: the layers vLLM opened for it get back what they held
(``unfinished_update``), and one error lists what is wrong, shard by shard.

Not held here: a model still at its cold start (the loaders hold it, and
nothing serves yet), a model name that is not a local directory (vLLM's
download of it), tensors of no Kimi-K3 routed-expert layer (vLLM's own
loaders judge them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vllm_kimi_k3_moe.formats.safetensors_headers import (
    CheckpointDirError,
    read_checkpoint_tensors,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partial_updates import (
    Sent,
    delivery,
)
from vllm_kimi_k3_moe.model_executor.model_loader.unfinished_update import (
    put_back_open_layers,
    what_the_engine_holds,
)

MOST_SHOWN = 8  # problems listed in the error; the rest counted


def hold_update_to_headers(model_config: Any, model: nn.Module) -> None:
    """Refuse, before anything is written, an update of ``model`` from the
    checkpoint directory ``model_config.model`` whose shard headers break a
    Kimi-K3 routed-expert layer's contract (see the module docstring)."""
    updating = [
        loading
        for module in model.modules()
        if (loading := getattr(module, "kimi_k3_expert_loading", None)) is not None
        and not loading.cold_start
    ]
    directory = Path(str(getattr(model_config, "model", "")))
    if not updating or not directory.is_dir():
        return
    try:
        checkpoint = read_checkpoint_tensors(directory)
    except CheckpointDirError:
        return  # no safetensors: vLLM's loader says so, or reads other files
    problems = [
        f"shard {shard} {why}" for shard, why in checkpoint.broken_shards.items()
    ]
    prefixes = {loading.sent_prefix: loading for loading in updating}
    sent = {id(loading): Sent() for loading in updating}
    for name, tensor in checkpoint.tensors.items():
        head, _, rest = name.rpartition(".")
        layer_and_expert, _, projection = head.rpartition(".")
        layer, _, expert = layer_and_expert.rpartition(".")
        loading = prefixes.get(f"{layer}.")
        contract = loading and loading.contracts.get((projection, rest))
        if not contract or not expert.isdigit():
            continue
        breaches = contract.breaches(tensor.shape, tensor.dtype)
        if breaches:
            where = checkpoint.shard_of.get(name, "?")
            problems.append(f"{name} (in {where}) {loading.describe(breaches)}")
        if loading.is_local(int(expert)):
            sent[id(loading)].add(int(expert), projection, rest)
    for loading in updating:
        found = delivery(
            sent[id(loading)], loading.local_experts(), loading.expert_tensors
        )
        problems += [
            f"{loading.sent_prefix}{expert}: {group} without {', '.join(missing)}"
            for expert, group, missing in found.partial
        ]
    if problems:
        shown = problems[:MOST_SHOWN]
        if len(problems) > MOST_SHOWN:
            shown.append(f"and {len(problems) - MOST_SHOWN} more")
        put_back = put_back_open_layers(model)
        raise ValueError(
            f"Kimi-K3 weight update from {directory} refused before any tensor "
            f"was written, by its shard headers: {'; '.join(shown)}. "
            + what_the_engine_holds(
                put_back, "Mend the checkpoint and send the update again"
            )
        )
