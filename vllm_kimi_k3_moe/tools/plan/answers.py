"""The plans of what ``plan`` was asked: kept from before where the same
question was answered on the same installation
(``tools.deployment.remembered``), else worked out by one ``Planner``, made
(importing vLLM) on the first question not kept.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

from vllm_kimi_k3_moe.tools.deployment.gpus import an_amd_gpu_named
from vllm_kimi_k3_moe.tools.deployment.remembered import CACHE_VARIABLE, remembered
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment
from vllm_kimi_k3_moe.tools.meta_rank.kernel_gpus import (
    KernelOnGpu,
    refuse_a_kernel_the_gpu_cannot_run,
    what_builds_instead,
)
from vllm_kimi_k3_moe.tools.meta_rank.quiet import quiet_vllm
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import a_gpu_of_capability
from vllm_kimi_k3_moe.tools.plan.asked import PlanInput
from vllm_kimi_k3_moe.tools.plan.planner import BuildRefused, PlanError, Planner
from vllm_kimi_k3_moe.tools.plan.values import DeploymentPlan

T = TypeVar("T")


class Answers:
    """The plans of what ``plan`` was asked: kept from before where the same
    question was answered on the same installation (``remembered``), else
    worked out by one ``Planner`` (made, importing vLLM, on the first
    question not kept)."""

    def __init__(self, asked: PlanInput, model: str, gpus_per_node: int) -> None:
        """``model``: the checkpoint the serve commands name
        (``served_model``)."""
        self._asked = asked
        self._model = model
        self._gpus_per_node = gpus_per_node
        self._planner: Planner | None = None

    def _question(self, *what: Any) -> tuple[Any, ...]:
        asked = self._asked
        return (
            "plan",
            asked.text_config,
            asked.quantization_config,
            asked.serving,
            asked.budget,
            self._model,
            self._gpus_per_node,
            asked.speculation,
            asked.online,
            asked.online_config,
            asked.capability,
            asked.amd_arch,
            asked.aiter,
            *what,
        )

    def _worked_out(self, work: Callable[[Planner], T]) -> T:
        """``work`` on the planner, made on first use (vLLM's output kept
        off the terminal), vLLM building as on the ``--gpu`` named, if one
        is (``a_gpu_of_capability``; an AMD GPU: ``an_amd_gpu_named``)."""
        if self._planner is None:
            print("importing vLLM and building its Kimi-K3 model ...", file=sys.stderr)
            asked = self._asked
            with quiet_vllm():
                self._planner = Planner(
                    asked.text_config,
                    asked.serving,
                    asked.budget,
                    self._model,
                    asked.quantization_config,
                    self._gpus_per_node,
                    asked.speculation,
                )
        with (
            quiet_vllm(),
            a_gpu_of_capability(self._asked.capability),
            an_amd_gpu_named(self._asked.amd_arch, self._asked.aiter),
        ):
            return work(self._planner)

    def advise(
        self, gpus: int, quantization: str | None = None, backend: str | None = None
    ) -> tuple[list[DeploymentPlan], list[str]]:
        """``Planner.advise`` of ``gpus`` GPUs in the format and kernel (by
        default the asked ones)."""
        quantization = quantization or self._asked.quantization
        backend = backend or self._asked.backend
        return remembered(
            self._question("advise", gpus, quantization, backend),
            lambda: self._worked_out(
                lambda planner: planner.advise(
                    gpus,
                    quantization,
                    backend,
                    self._asked.online,
                    self._asked.online_config,
                )
            ),
        )

    def plan(self, deployments: list[Deployment]) -> list[DeploymentPlan]:
        """``Planner.plan`` of each of ``deployments``; where vLLM refuses
        one, ``PlanError`` saying why and what vLLM builds instead."""
        try:
            return remembered(
                self._question("plan", deployments),
                lambda: self._worked_out(
                    lambda planner: [planner.plan(d) for d in deployments]
                ),
            )
        except BuildRefused as refused:
            raise PlanError(self._and_instead(refused)) from refused

    def _and_instead(self, refused: BuildRefused) -> str:
        """``refused``'s words and what vLLM builds instead
        (``kernel_gpus.what_builds_instead``), if anything."""
        asked = self._asked
        instead = self._worked_out(
            lambda planner: what_builds_instead(
                asked.text_config,
                refused.deployment,
                asked.capability,
                asked.quantization_config,
            )
        )
        return f"{refused}; {instead}" if instead else str(refused)

    def plan_one(self, deployment: Deployment) -> DeploymentPlan:
        return self.plan([deployment])[0]

    def kernel_on_gpu(self, gpu: str, deployment: Deployment) -> KernelOnGpu:
        """vLLM's kernel for ``deployment``'s ``--moe-backend`` on ``gpu``
        (``DeploymentError`` where it selects none, which is not kept)."""
        asked = self._asked
        return remembered(
            self._question("kernel", gpu, deployment),
            lambda: self._worked_out(
                lambda planner: refuse_a_kernel_the_gpu_cannot_run(
                    asked.text_config, deployment, gpu, asked.quantization_config
                )
            ),
        )

    def kernel_of_the_asked(self, gpu: str | None) -> KernelOnGpu | None:
        """With ``--gpu NAME``: vLLM's kernel for the asked ``--moe-backend``
        on that GPU, for the first layout asked (the advisor's: any);
        ``DeploymentError`` where it selects none (``kernel_gpus``)."""
        if gpu is None:
            return None
        asked = self._asked
        deployment = (
            asked.deployments[0]
            if asked.deployments
            else Deployment(
                1,
                backend=asked.backend,
                quantization=asked.quantization,
                online=asked.online,
                online_config=asked.online_config,
            )
        )
        return self.kernel_on_gpu(gpu, deployment)

    def note_if_kept(self) -> None:
        """Say (stderr) that no model was built: every answer was kept."""
        if self._planner is None:
            print(
                "plan: asked before on this vLLM, plugin and config: the kept "
                f"answer, vLLM not imported ({CACHE_VARIABLE}=off builds again)",
                file=sys.stderr,
            )

    def close(self) -> None:
        if self._planner is not None:
            self._planner.close()
