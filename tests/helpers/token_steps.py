"""A few AdamW steps of a language model on random tokens (each token predicts itself), for the GPU tests that compare
two ways of running one model: the losses of every step and the first step's gradients."""

from typing import Dict, List, Optional, Tuple

import torch


def adamw_steps(model: torch.nn.Module, steps: int, vocab: int = 1024, shape: Tuple[int, int] = (4, 128),
                device: str = "cuda") -> Tuple[List[float], Optional[Dict[str, torch.Tensor]]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    losses: List[float] = []
    grads = None
    for step in range(steps):
        ids = torch.randint(0, vocab, shape, generator=gen).to(device)
        loss = model(ids, labels=ids).float().mean()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads
