"""
Muon (MomentUm Orthogonalized by Newton-Schulz, Keller Jordan 2024) for the hidden weight matrices,
AdamW for everything else (embeddings, output head, norm gains, biases), in one optimizer so that a
single state_dict() checkpoints both and the training loop sets every group's lr the same way.

Muon keeps SGD momentum, but instead of stepping along the momentum M = U S V^T it steps along
U V^T: every direction the matrix can move in gets the same step size, so rare directions are not
drowned out by the dominant ones. U V^T is approximated by a few Newton-Schulz iterations (matmuls
only, no SVD).
"""

import torch


def orthogonalize(G, steps=5, eps=1e-7):
    """Approximately U V^T for G = U S V^T (G 2-D, or a batch of matrices in the last two dims).

    Each iteration applies the odd polynomial p(x) = a x + b x^3 + c x^5 to every singular value.
    These coefficients (Jordan's) make p'(0) = 3.4 large, so small singular values grow fast, at the
    price of not converging to exactly 1: after 5 steps they lie roughly in [0.7, 1.2], which works
    as well as exact orthogonalization for optimization."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.float()
    wide = X.size(-2) <= X.size(-1)
    if not wide:  # iterate on the wide orientation: X X^T is then the smaller square
        X = X.mT
    # Frobenius norm >= spectral norm: all singular values <= 1
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return (X if wide else X.mT).to(G.dtype)


class Muon(torch.optim.Optimizer):
    """Param groups with use_muon=True (2-D matrices only) get Muon, the others AdamW.

    Muon groups: lr, momentum, nesterov, ns_steps, weight_decay. AdamW groups: lr, betas, eps,
    weight_decay. Every group may carry lr_scale (its lr relative to the scheduled base lr), which
    the training loop uses; the optimizer itself only reads lr. Use muon_param_groups() to build them."""

    def __init__(self, param_groups):
        for group in param_groups:
            if group['use_muon'] and any(p.dim() != 2 for p in group['params']):
                raise ValueError("lm/muon.py: a use_muon group holds a parameter that is not a 2-D matrix; "
                                 "put vectors and scalars in an AdamW group (use_muon=False).")
        super().__init__(param_groups, dict())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group['use_muon']:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group):
        lr, momentum = group['lr'], group['momentum']
        for p in group['params']:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state['momentum_buffer'] = torch.zeros_like(p)
            buf = state['momentum_buffer']
            buf.lerp_(p.grad, 1 - momentum)  # exponential moving average of the gradient
            update = p.grad.lerp(buf, momentum) if group['nesterov'] else buf
            update = orthogonalize(update, group['ns_steps'])
            # U V^T of a tall (out > in) matrix has row norms sqrt(in/out): rescale so the step per
            # output unit does not shrink as the matrix gets taller
            scale = max(1.0, p.size(0) / p.size(1)) ** 0.5
            p.mul_(1 - lr * group['weight_decay'])
            p.add_(update, alpha=-lr * scale)

    def _adamw_step(self, group):
        lr, (beta1, beta2), eps = group['lr'], group['betas'], group['eps']
        for p in group['params']:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state['step'] = 0
                state['exp_avg'] = torch.zeros_like(p)
                state['exp_avg_sq'] = torch.zeros_like(p)
            state['step'] += 1
            exp_avg, exp_avg_sq = state['exp_avg'], state['exp_avg_sq']
            exp_avg.lerp_(p.grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            bias1, bias2 = 1 - beta1 ** state['step'], 1 - beta2 ** state['step']
            denom = (exp_avg_sq / bias2).sqrt_().add_(eps)
            p.mul_(1 - lr * group['weight_decay'])  # decoupled weight decay
            p.addcdiv_(exp_avg, denom, value=-lr / bias1)


def muon_param_groups(model, learning_rate, weight_decay, betas, muon_lr, muon_momentum=0.95,
                      muon_weight_decay=0.0, ns_steps=5):
    """Param groups for Muon(): the 2-D weights inside the transformer blocks get Muon; the token
    (and position) embeddings, an untied lm_head and all vectors get AdamW. As in
    GPT.configure_optimizers, AdamW decays only matmul weights (here: an untied lm_head)."""
    hidden = {id(p) for p in model.transformer.h.parameters() if p.dim() == 2}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]
    muon = [p for p in params if id(p) in hidden]
    decay = [p for p in params if id(p) not in hidden and p.dim() >= 2 and id(p) not in embeddings]
    no_decay = [p for p in params if id(p) not in hidden and (p.dim() < 2 or id(p) in embeddings)]
    adamw = dict(use_muon=False, lr=learning_rate, lr_scale=1.0, betas=betas, eps=1e-8)
    return [
        dict(params=muon, use_muon=True, lr=muon_lr, lr_scale=muon_lr / learning_rate, momentum=muon_momentum,
             nesterov=True, ns_steps=ns_steps, weight_decay=muon_weight_decay),
        dict(params=decay, weight_decay=weight_decay, **adamw),
        dict(params=no_decay, weight_decay=0.0, **adamw),
    ]
