"""Calls of a spec with score and mask modifiers (issue 41): ``ModifiedCalls`` is
FlashAttention's part for them (fadsl/runtime/attention.py). ``kern(q, k, v, ...,
**inputs)`` takes the spec's `input` tensors by name (and ``keep_classes=``, the tile classes
made ahead: fadsl/runtime/keep_classes.py); ``kern.keep_classes(q, k, **inputs)`` makes those.
Eager calls without gradients launch directly; with gradients, one autograd Function
(fadsl/runtime/eager_grad.py); under torch.compile, the modified op
(fadsl/runtime/modified_op.py).
"""

from __future__ import annotations

from . import keep_classes
from .arguments import check_longest, modifier_inputs
from .learnable import learning
from .plans import stream_and_device


class ModifiedCalls:
    """The modified calls of FlashAttention (which provides config, has_backward, forward,
    _modified_op and the kernels)."""

    def keep_classes(self, q, k, **inputs):
        """The tile classes of a keep that reads inputs per token, made once for calls on
        q's and k's shapes and these inputs (the spec's, by name), to pass to each of them as
        ``keep_classes=`` (fadsl/runtime/keep_classes.py); on q's device and stream."""
        if self.config.modifiers is None:
            raise TypeError(
                f"kernel '{self.config.name}' has no keep (no score or mask modifiers): it "
                "classes no tiles"
            )
        check_longest(self.config.modifiers, q, k, self.config.name)
        tensors = modifier_inputs(self.config.modifiers.inputs, inputs, q, k, self.config.name)
        return keep_classes.make(self, q, k, tensors)

    def _call_modified(self, q, k, v, scale: float, out, return_lse: bool, inputs: dict):
        """A call of a spec with score or mask modifiers (issue 41): the inputs checked by
        name, dtype, shape, device and layout (and keep_classes against what they were made
        from); eager calls without gradients launch directly, eager calls with gradients run
        through one autograd Function (eager_grad.modified), compiled calls through the
        modified op (fadsl/runtime/modified_op.py); either backward runs the spec's backward
        kernels with the same inputs and gives the inputs that require grad their gradients
        (fadsl/runtime/learnable.py, which refuses, by name, one that cannot have any)."""
        import torch

        decls = () if self.config.modifiers is None else self.config.modifiers.inputs
        name = self.config.name
        classes = keep_classes.taken(inputs)  # (made ahead: keep_classes.py)
        key = None
        modifiers = self.config.modifiers
        rule = None if modifiers is None else modifiers.rule
        classed_by_call = rule is not None and rule.by_pass and classes is None
        planned = out is None and modifiers is not None and not classed_by_call
        if planned and not torch.compiler.is_compiling():
            key = self._modified_signature(q, k, v, scale, return_lse, inputs, classes)
            plan = None if key is None else self._plans.get(key)
            if plan is not None:  # (the checks' verdict is the signature's; classes: their own)
                tensors = tuple(inputs[d.name] for d in decls)
                if classes is not None:
                    keep_classes.check(self, classes, q, k, tensors)
                    tensors += tuple(classes.forward)
                return plan(q, k, v, tensors)
        if not decls:  # (a keyword the spec does not take: reported as Python would, first)
            modifier_inputs(decls, inputs, q, k, name)
        check_longest(modifiers, q, k, name)
        tensors = modifier_inputs(decls, inputs, q, k, name)
        if classes is not None:
            keep_classes.check(self, classes, q, k, tensors)
            tensors += tuple(classes.tensors())
        grad_mode = torch.is_grad_enabled()
        learn = learning(self, decls, tensors)  # (refuses an input that cannot learn, by name)
        grads = grad_mode and (any(t.requires_grad for t in (q, k, v)) or any(learn))
        if not grads and not torch.compiler.is_compiling():
            if key is not None:  # (planned at its signature's second call)
                return self._launch_planning(self._plans, key, q, k, v, scale, return_lse, tensors)
            return self.forward(q, k, v, scale, out, return_lse, tensors)
        if grads and out is not None:
            raise RuntimeError(
                f"fadsl kernel '{name}': out= does not support automatic differentiation; "
                "call it without out=, under torch.no_grad(), or with q, k and v detached"
            )
        if self.has_backward and not torch.compiler.is_compiling():  # (no dispatcher)
            from . import eager_grad

            o, lse = eager_grad.modified(self, scale, q, k, v, tensors)
        else:
            o, lse = self._modified_op(
                q, k, v, list(tensors), scale, return_lse or self.has_backward
            )
        if out is not None:  # (compiled, without gradients)
            out.copy_(o)
            o = out
        return (o, lse) if return_lse else o

    def _modified_signature(self, q, k, v, scale: float, return_lse: bool, inputs: dict, classes):
        """A modified call's signature for its launch plan (fadsl/runtime/plans.py): q's,
        k's, v's and each named input's shape, strides, dtype and device, the scale,
        return_lse, whether classes were made ahead (they are checked on every call: their
        verdict rests on the inputs' identity and versions), the stream and device; None
        where gradients may flow (those calls take the autograd Function) or no signature
        can be formed (the checked path names the argument)."""
        import torch

        try:
            tensors = (q, k, v, *inputs.values())
            if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
                return None
            named = tuple((n, t.shape, t.stride(), t.dtype, t.device) for n, t in inputs.items())
            return (
                *(q.shape, q.stride(), q.dtype, q.device),
                *(k.shape, k.stride(), k.dtype, k.device),
                *(v.shape, v.stride(), v.dtype, v.device),
                *(type(scale), scale, return_lse, named, classes is None),
                *stream_and_device(q.device.index),
            )
        except Exception:  # (not a tensor, an unhashable value: the checks say what)
            return None
