"""W4A16 matmul on an NVFP4 weight: y = x @ dequantize(W).T, and QuantLinear, the module built on it.

(The Triton kernels land here; this first version is the torch path they will be checked against.)

The frozen base weight never exists in bf16 as a whole: forward dequantizes, multiplies, and drops
the copy; backward (dX = dY @ dequantize(W); the weight itself gets no gradient) dequantizes again
instead of keeping the copy alive, so training through an NVFP4 model holds at most one layer's
dequantized weight at a time.
"""
import torch
import torch.nn as nn

import nvfp4


class _FP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, scale, global_scale):
        ctx.save_for_backward(packed, scale, global_scale)
        w = nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scale, global_scale), x.dtype)  # (N, K)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad_y):
        packed, scale, global_scale = ctx.saved_tensors
        w = nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scale, global_scale), grad_y.dtype)  # (N, K)
        return grad_y @ w, None, None, None


def fp4_linear(x, q, bias=None):
    """x (..., K) @ dequantize(q).T (+ bias) → (..., N), differentiable in x (and bias)."""
    y = _FP4LinearFn.apply(x, q.packed, q.scale, q.global_scale)
    return y + bias.to(y.dtype) if bias is not None else y


class QuantLinear(nn.Module):
    """A frozen linear layer stored in NVFP4; a drop-in for nn.Linear.

    Buffers carry compressed-tensors' names (weight_packed, weight_scale, weight_global_scale), so
    this module's state_dict keys are the checkpoint's keys."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=torch.bfloat16):
        super().__init__()
        if in_features % nvfp4.BLOCK:
            raise ValueError(f"QuantLinear: in_features {in_features} is not a multiple of {nvfp4.BLOCK}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // nvfp4.BLOCK,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear, name="weight"):
        q = nvfp4.quantize(linear.weight.data, name=name)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None,
                device=linear.weight.device, dtype=linear.weight.dtype)
        m.weight_packed.copy_(q.packed)
        m.weight_scale.copy_(q.scale)
        m.weight_global_scale.copy_(q.global_scale)
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.data)
        return m

    @property
    def q(self):
        return nvfp4.NVFP4Tensor(self.weight_packed, self.weight_scale, self.weight_global_scale)

    def dequantized_weight(self, dtype=torch.float32):
        return nvfp4.dequantize(self.q, dtype)

    def forward(self, x):
        return fp4_linear(x, self.q, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nvfp4"


def is_decoder_linear(name, module):
    """The layers QeRL quantizes: q/k/v/o and gate/up/down of every decoder layer, not lm_head."""
    return isinstance(module, nn.Linear) and name.split(".")[-1] in nvfp4.LINEAR_NAMES


def quantize_model(model, filter=is_decoder_linear):
    """Swap every decoder nn.Linear of `model` (a model.Transformer) for a QuantLinear, in place."""
    return model.swap_linears(lambda name, m: QuantLinear.from_linear(m, name=name + ".weight"), filter)
