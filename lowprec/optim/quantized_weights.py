"""Training quantized weights: fp32 master copies behind a standard torch.optim optimizer."""

from __future__ import annotations

import torch

from ..formats import QuantizedTensor


class QuantizedWeightOptimizer:
    """Wrap ``optimizer_cls`` (any ``torch.optim`` optimizer) for a model whose lowprec
    modules were built under :func:`lowprec.quantized_model_init`.

    Each quantized weight gets an fp32 master copy that the wrapped optimizer
    updates; after every step the master is re-quantized *in place* into the
    weight's buffers, with every usage the weight holds (usages only grow).
    Other parameters are handed to the optimizer unchanged.
    """

    def __init__(self, model: torch.nn.Module, optimizer_cls, **optimizer_kwargs) -> None:
        from ..modules import LowprecModule

        self._links = []  # (module, gemm index, quantized parameter, fp32 master)
        plain, seen = [], set()
        for module in model.modules():
            if not isinstance(module, LowprecModule):
                continue
            for i, pname in enumerate(module._weight_names()):
                p = getattr(module, pname)
                if isinstance(p, QuantizedTensor) and id(p) not in seen:
                    seen.add(id(p))
                    master = p.dequantize(torch.float32).detach().clone().requires_grad_(True)
                    self._links.append((module, i, p, master))
        for p in model.parameters():
            if id(p) not in seen and p.requires_grad:
                plain.append(p)
        masters = [link[3] for link in self._links]
        self.optimizer = optimizer_cls(masters + plain, **optimizer_kwargs)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for _, _, p, _ in self._links:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for _, _, p, master in self._links:
            master.grad = None if p.grad is None else p.grad.to(torch.float32)
        self.optimizer.step()
        for module, i, p, master in self._links:
            module.weight_quantizer(i, master.device).update_quantized(master, p)

    def master_weights(self) -> list[torch.Tensor]:
        return [link[3] for link in self._links]

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "masters": [m.detach().clone() for m in self.master_weights()]}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for m, saved in zip(self.master_weights(), state["masters"]):
                m.copy_(saved)
