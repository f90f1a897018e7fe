"""What a backend implements. Validation and layout live outside; a backend moves bytes.

Legend: T tokens, K routes per token, H hidden, B scale blocks, R output rows.
"""

from __future__ import annotations

import abc

import torch

from ..config import BufferConfig, KernelConfig
from ..handle import DispatchHandle
from ..memory import MemoryPlan
from ..refusals import refused_here
from ..routing import Routing


class Backend(abc.ABC):
    name: str = ""
    # True: expert ids are range- and duplicate-checked by the device, so the buffer skips the
    # host checks that would synchronise (and break CUDA graph capture).
    checks_routing_on_device: bool = False
    # True: a dynamic-size dispatch (num_out_tokens=None) reads the bad expert ids back with its
    # output sizes, in the one host read it makes anyway, and raises them, so the buffer skips
    # the host checks' own read there.
    reports_dynamic_routing: bool = False

    def __init__(self, config: BufferConfig, group, rank: int, owner: int):
        self.config = config
        self.group = group
        self.rank = rank
        self.owner = owner

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where x must live for this group's transport."""

    @abc.abstractmethod
    def dispatch(
        self,
        x_TH: torch.Tensor,
        scales_TB: torch.Tensor | None,
        routing: Routing | None,
        handle: DispatchHandle | None,
        num_out_tokens: int | None,
        kernel_config: KernelConfig,
    ) -> tuple[torch.Tensor, torch.Tensor | None, DispatchHandle]:
        """Return (rows_RH, scales_RB or None, handle). Exactly one of routing / handle is given."""

    def refuse_dispatch(self, error: BaseException, num_out_tokens, handle,
                        kernel_config: KernelConfig) -> BaseException:
        """This rank's dispatch input failed its checks (error): tell the peers, whose calls are
        already in the exchange, through it, and return the error this rank raises
        (refusals.InputRefused, refusals.py). In a group of one no peer waits: the check's own error."""
        return error

    def refuse_combine(self, error: BaseException, handle, apply_probs: bool,
                       kernel_config: KernelConfig) -> BaseException:
        """refuse_dispatch for a combine. Where the combine has no exchange to carry the refusal
        (the cuda kernels), the peers' kernels give up after HYBRID_EP_TIMEOUT_S naming this rank."""
        return error if self.config.world_size == 1 else refused_here(self.rank, "combine", error)

    @abc.abstractmethod
    def combine(
        self, rows_RH: torch.Tensor, handle: DispatchHandle, apply_probs: bool, kernel_config: KernelConfig
    ) -> torch.Tensor:
        """Sum each token's rows (fp32 accumulation) back on its source rank: [T, H]."""

    @abc.abstractmethod
    def return_row_values(self, values_R: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Send one fp32 value per output row back to its route: [T, K], 0 where none.

        This is the backward of the probs that dispatch hands out.
        """

    def combine_and_return_row_values(
        self, rows_RH: torch.Tensor, values_R: torch.Tensor, handle: DispatchHandle, kernel_config: KernelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both halves of dispatch's backward (combine without probs, then return_row_values);
        a backend that can send both back in one exchange overrides it."""
        return self.combine(rows_RH, handle, False, kernel_config), self.return_row_values(values_R, handle)

    @abc.abstractmethod
    def memory_plan(self, dtype: torch.dtype = torch.bfloat16) -> MemoryPlan:
        """What the buffer holds and needs per call, for calls that dispatch `dtype` rows."""

    def expert_out_view(self, handle: DispatchHandle, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """HybridEPBuffer.expert_out_view: a plain tensor unless the backend's combine can read
        one of its own memory in place."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def is_in_peer_memory(self, t: torch.Tensor) -> bool:
        """HybridEPBuffer.is_in_peer_memory: whether t lies in memory the rank's peers read in
        place; none by default."""
        return False

    def release_unused(self) -> None:
        """Give back memory grown for outputs that no output uses any more (HybridEPBuffer.release_unused);
        nothing to give back by default."""
